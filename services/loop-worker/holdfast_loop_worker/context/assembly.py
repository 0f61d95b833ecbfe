"""Context assembly: the sections of a model call, put together in order.

The sections, in the order the reference gives them: the agent's system
prompt, the soul, the recent turns, working memory, retrieved memory, the
tool definitions. They become a :class:`ModelRequest` whose providers render
the stable parts first (tools, system prompt, soul) and the changing ones
last (``notes``: working and retrieved memory, after the newest message), so
consecutive calls of a task share as long a prefix as possible and prompt
caches hold.

Once the task has been compacted, the turns before the summary's last
message are not sent: the summary is, inside the soul block, labelled as the
engine's summary — never as something the user said. If the first message
kept is the model's (a compaction inside a long turn), the user message that
opened its turn is shown again before it: the model always sees what it was
asked, and a conversation that opens with a user message (every provider
wants one).

A tool result longer than ``tool_result_chars`` is sent as its head and tail
with a note of what was cut; the event log keeps it whole.

Everything here is pure: no Redis, no PostgreSQL, no clock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from holdfast_shared.conversation import ChatMessage, for_provider
from holdfast_shared.providers.base import ModelRequest
from holdfast_shared.tools import ToolSpec

from holdfast_loop_worker.context import tokens
from holdfast_loop_worker.context.tool_media import with_tool_media
from holdfast_loop_worker.context.working_memory import render as render_working_memory

SUMMARY_HEADING = (
    "# Earlier in this task\n"
    "The conversation before the messages that follow was long, so the engine replaced it "
    "with this summary (written by a model, not by the user):\n\n"
)


@dataclass(frozen=True, slots=True)
class Summary:
    """A stored summary: it stands for every message with ``id <= last_message_id``."""

    last_message_id: int
    text: str


@dataclass(frozen=True, slots=True)
class Sections:
    """What one model call's context is made of, in the reference's order."""

    system_prompt: str
    soul: str
    history: Sequence[ChatMessage]
    summary: Summary | None = None
    working_memory: Mapping[str, str] = field(default_factory=dict)
    retrieved: Sequence[str] = ()
    tools: Sequence[ToolSpec] = ()


@dataclass(frozen=True, slots=True)
class Assembled:
    request: ModelRequest
    # The local estimate of the request's size (uncalibrated tokens).
    tokens: int
    # The messages sent: those after the summary (and a turn's opening
    # message shown again, where one is).
    view: tuple[ChatMessage, ...]
    # Tokens of everything but the messages: prompt, soul, summary, notes, tools.
    fixed_tokens: int


def visible(history: Sequence[ChatMessage], summary: Summary | None) -> list[ChatMessage]:
    """The messages after the summary, opening with a user message."""
    if summary is None:
        return list(history)
    kept = [m for m in history if m.id > summary.last_message_id]
    if kept and kept[0].role == "assistant":
        opener = turn_opener(history, kept[0].turn_id)
        if opener is not None:
            kept.insert(0, opener)
    return kept


def turn_opener(history: Sequence[ChatMessage], turn_id: str) -> ChatMessage | None:
    """The user message that opened the turn ``turn_id``."""
    for message in history:
        if message.turn_id == turn_id and message.role == "user" and message.position == 0:
            return message
    return None


def fit_tool_results(message: ChatMessage, max_chars: int) -> ChatMessage:
    """``message`` with each tool result longer than ``max_chars`` cut to its
    head and tail, and a note saying how much was left out."""
    if message.role != "user" or not any(b.get("type") == "tool_result" for b in message.blocks):
        return message
    blocks = tuple(
        _fit(b, max_chars) if b.get("type") == "tool_result" else b for b in message.blocks
    )
    return replace(message, blocks=blocks)


def _fit(block: dict[str, Any], max_chars: int) -> dict[str, Any]:
    output = block.get("output")
    text = output if isinstance(output, str) else json.dumps(output, default=str)
    if len(text) <= max_chars:
        return block
    head, tail = text[: max_chars * 2 // 3], text[-(max_chars // 3) :]
    cut = len(text) - len(head) - len(tail)
    note = (
        f"\n[... {cut} characters of this tool result left out of the context; "
        "the whole result is in the task's event log ...]\n"
    )
    return {**block, "output": head + note + tail}


def render_soul(soul: str, summary: Summary | None) -> str:
    """The soul block: the soul, then the summary of earlier turns."""
    parts = [soul] if soul else []
    if summary is not None:
        parts.append(SUMMARY_HEADING + summary.text)
    return "\n\n".join(parts)


def render_notes(working_memory: Mapping[str, str], retrieved: Sequence[str]) -> str:
    parts = []
    if working := render_working_memory(working_memory):
        parts.append(working)
    if retrieved:
        parts.append(
            "# Retrieved memory (from earlier tasks; may be out of date)\n"
            + "\n".join(f"- {item}" for item in retrieved)
        )
    return "\n\n".join(parts)


# Messages are immutable once stored: their estimates are kept by row id.
_MESSAGE_TOKENS: OrderedDict[tuple[int, str], int] = OrderedDict()
_MESSAGE_TOKENS_MAX = 200_000


def message_tokens(message: ChatMessage) -> int:
    if not message.id:
        return tokens.message_tokens(message)
    key = (message.id, message.provider or "")
    found = _MESSAGE_TOKENS.get(key)
    if found is None:
        found = _MESSAGE_TOKENS[key] = tokens.message_tokens(message)
        if len(_MESSAGE_TOKENS) > _MESSAGE_TOKENS_MAX:
            _MESSAGE_TOKENS.popitem(last=False)
    return found


def assemble(
    sections: Sections,
    *,
    model: str,
    provider: str,
    cache_key: str | None = None,
    max_tokens: int = 4096,
    tool_result_chars: int = 20_000,
) -> Assembled:
    """The request for one model call of ``provider``'s ``model``, and its size."""
    view = [
        # A tool's images and audio go as media before the result is cut to size.
        fit_tool_results(with_tool_media(m, provider=provider, model=model), tool_result_chars)
        for m in for_provider(visible(sections.history, sections.summary), provider)
    ]
    soul = render_soul(sections.soul, sections.summary)
    notes = render_notes(sections.working_memory, sections.retrieved)
    fixed = (
        tokens.text_tokens(sections.system_prompt)
        + tokens.text_tokens(soul)
        + tokens.text_tokens(notes)
        + tokens.tools_tokens(sections.tools)
    )
    request = ModelRequest(
        model=model,
        system=sections.system_prompt,
        messages=tuple(view),
        tools=tuple(sections.tools),
        max_tokens=max_tokens,
        soul=soul,
        notes=notes,
        cache_key=cache_key,
    )
    total = fixed + sum(message_tokens(m) for m in view)
    return Assembled(request, total, tuple(view), fixed)
