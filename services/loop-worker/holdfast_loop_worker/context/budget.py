"""Budgets for small context windows (#31): the fixed sections trimmed to a
share of the window, the output limit fitted to what the prompt leaves, and
a provider's overflow turned into what the engine learns of the window.

A local model may have a window of 2,048 tokens, in which the agent's system
prompt, its tool definitions, the skills and the memory notes alone would
leave no room for the conversation. Rather than refuse the model, the fixed
sections are trimmed, cheapest loss first, until they take at most
``FIXED_SHARE`` of the compaction threshold:

1. retrieved memories, the last (least relevant) first;
2. the Skills section, to the skills' names (``skill`` still returns each
   one's instructions);
3. tool definitions: descriptions cut to their first sentence and the
   schemas' own descriptions dropped, then descriptions dropped altogether
   (names and parameters stay: the model can still call every tool).

Only when even that does not leave room for a conversation is the model
unusable (:func:`unfit_reason`): the worker says so and the gateway refuses
it (422 ``MODEL_UNAVAILABLE``) instead of queueing turns nobody can run.

Everything here is pure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from holdfast_shared.errors import ErrorCode
from holdfast_shared.providers import ProviderError
from holdfast_shared.tools import ToolSpec

from holdfast_loop_worker.context import tokens
from holdfast_loop_worker.context.assembly import Sections, render_notes, render_soul

# Of the compaction threshold, what the fixed sections may take before they
# are trimmed: the rest is the conversation's.
FIXED_SHARE = 0.5
# An answer shorter than this is not worth asking for; the prompt is
# compacted instead.
MIN_OUTPUT_TOKENS = 256
# What a conversation needs at the least beside the fixed sections: the
# newest message and a summary of the rest.
MIN_CONVERSATION_TOKENS = 256
# Tokenizers differ from the estimate: this much of the window is kept free.
_MARGIN = 0.05
# No window is smaller than HOLDFAST_CONTEXT_WINDOW's lower bound.
MIN_WINDOW = 1024
_FIRST_SENTENCE = re.compile(r"^(.+?[.!?])(\s|$)", re.S)
_SHORT_DESCRIPTION_CHARS = 160


def output_tokens(window: int, prompt_tokens: int, wanted: int) -> int:
    """The output limit of a call whose prompt takes ``prompt_tokens`` of
    ``window``: ``wanted``, or what the window leaves (never below
    ``MIN_OUTPUT_TOKENS``, nor above ``wanted``)."""
    room = int(window * (1 - _MARGIN)) - prompt_tokens
    return max(min(wanted, MIN_OUTPUT_TOKENS), min(wanted, room))


def fixed_tokens(sections: Sections) -> int:
    """The estimate of everything in ``sections`` but the messages."""
    return (
        tokens.text_tokens(sections.system_prompt)
        + tokens.text_tokens(render_soul(sections.soul, sections.summary))
        + tokens.text_tokens(render_notes(sections.working_memory, sections.retrieved))
        + tokens.tools_tokens(sections.tools)
    )


def fixed_budget(window: int, threshold: float) -> int:
    return int(window * threshold * FIXED_SHARE)


def trim(sections: Sections, budget: int, brief_system_prompt: str | None = None) -> Sections:
    """``sections`` with their fixed part trimmed, step by step, until its
    estimate is within ``budget`` (or nothing is left to trim)."""
    for step in _steps(brief_system_prompt):
        if fixed_tokens(sections) <= budget:
            break
        sections = step(sections, budget)
    return sections


def smallest(sections: Sections, brief_system_prompt: str | None = None) -> Sections:
    """``sections`` trimmed as far as they go."""
    return trim(sections, 0, brief_system_prompt)


def unfit_reason(
    model: str,
    window: int,
    threshold: float,
    system_prompt: str,
    tools: Sequence[ToolSpec],
) -> str | None:
    """Why ``model`` cannot serve an agent with this prompt and these tools in
    ``window`` tokens even trimmed, or None when it can."""
    least = smallest(Sections(system_prompt=system_prompt, soul="", history=(), tools=tools))
    fixed = fixed_tokens(least)
    needed = fixed + MIN_CONVERSATION_TOKENS
    if needed + MIN_OUTPUT_TOKENS <= window and needed <= window * threshold:
        return None
    return (
        f"the context window of {model} ({window} tokens) is too small: the system prompt "
        f"and tool definitions take ~{fixed} tokens even trimmed, and a conversation and "
        f"an answer need ~{MIN_CONVERSATION_TOKENS + MIN_OUTPUT_TOKENS} more (within "
        f"HOLDFAST_COMPACTION_THRESHOLD, {threshold}, of the window)"
    )


def _steps(brief_system_prompt: str | None) -> list[Any]:
    def skills_by_name(sections: Sections, budget: int) -> Sections:
        if brief_system_prompt is None:
            return sections
        return replace(sections, system_prompt=brief_system_prompt)

    return [_fewer_memories, skills_by_name, _short_tools, _bare_tools]


def _fewer_memories(sections: Sections, budget: int) -> Sections:
    retrieved = list(sections.retrieved)
    while retrieved and fixed_tokens(replace(sections, retrieved=retrieved)) > budget:
        retrieved.pop()
    return replace(sections, retrieved=tuple(retrieved))


def _short_tools(sections: Sections, budget: int) -> Sections:
    return replace(
        sections,
        tools=tuple(
            replace(
                t,
                description=short_description(t.description),
                input_schema=without_descriptions(t.input_schema),
            )
            for t in sections.tools
        ),
    )


def _bare_tools(sections: Sections, budget: int) -> Sections:
    return replace(sections, tools=tuple(replace(t, description="") for t in sections.tools))


def short_description(text: str) -> str:
    """The first sentence of ``text``, at most ``_SHORT_DESCRIPTION_CHARS``."""
    found = _FIRST_SENTENCE.match(text.strip())
    first = found.group(1) if found else text.strip()
    if len(first) > _SHORT_DESCRIPTION_CHARS:
        first = first[: _SHORT_DESCRIPTION_CHARS - 1].rstrip() + "…"
    return first


def without_descriptions(schema: Any) -> Any:
    """A JSON schema without its ``description`` and ``examples`` entries (a
    property that is itself named so is kept)."""
    if isinstance(schema, Mapping):
        kept: dict[str, Any] = {}
        for key, value in schema.items():
            if key in ("description", "examples") and not isinstance(value, Mapping):
                continue
            if key == "properties" and isinstance(value, Mapping):
                kept[key] = {name: without_descriptions(v) for name, v in value.items()}
            else:
                kept[key] = without_descriptions(value)
        return kept
    if isinstance(schema, list):
        return [without_descriptions(item) for item in schema]
    return schema


# --- overflows -------------------------------------------------------------------

# The window a provider's overflow message names: llama.cpp's "exceed context
# window of 2048" and "available context size (2048 tokens)", vLLM's and
# OpenAI's "maximum context length is 2048 tokens", Ollama's "n_ctx=2048".
_WINDOW_IN_MESSAGE = re.compile(
    r"(?:context window of|context size \(|maximum context length is|n_ctx\s*[=:]\s*)"
    r"\s*(\d{3,8})",
    re.I,
)


@dataclass(frozen=True, slots=True)
class Overflow:
    """A call the provider found too long for the model's window."""

    # The refused prompt's size (calibrated estimate).
    prompt_tokens: int
    # The window the provider named, if it did.
    window: int | None
    # Only inferred (a stream that ended before any output, nothing said).
    suspected: bool


def overflow_of(exc: ProviderError, prompt_tokens: int, fitted: int = 0) -> Overflow | None:
    """``exc`` as an overflow of a ``prompt_tokens`` prompt, or None when it is
    something else. A stream cut before any output is taken for one only on a
    prompt big enough to fill some window (``MIN_WINDOW``) and bigger than
    ``fitted``, the largest the model answered before: a local server cuts a
    request it drops for another caller's (llama-cpp-python's
    ``interrupt_requests``) the same way, and a real trial took that for an
    overflow and shrank the window below prompts that had fit."""
    if exc.code != ErrorCode.CONTEXT_OVERFLOW:
        return None
    suspected = bool((exc.details or {}).get("suspected_overflow"))
    if suspected and (prompt_tokens < MIN_WINDOW * (1 - _MARGIN) or prompt_tokens <= fitted):
        return None
    found = _WINDOW_IN_MESSAGE.search(exc.message)
    return Overflow(prompt_tokens, int(found.group(1)) if found else None, suspected)


def learned_window(overflow: Overflow, current: int, fitted: int = 0) -> int:
    """The window to assume after ``overflow``: the one the provider named, or
    less than the refused prompt, but not below ``fitted`` (a prompt the model
    answered) nor ``MIN_WINDOW``."""
    if overflow.window is not None:
        return max(MIN_WINDOW, min(current, overflow.window))
    guess = int(overflow.prompt_tokens * (1 - _MARGIN))
    return max(MIN_WINDOW, min(current, max(guess, fitted)))
