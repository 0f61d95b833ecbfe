"""Small context windows (#31, 1): the fixed sections trimmed rather than
refused, max_tokens fitted to what the window leaves, overflows recognised and
the window they imply learned."""

from __future__ import annotations

import pytest
from holdfast_loop_worker.context import budget, tokens
from holdfast_loop_worker.context.assembly import Sections
from holdfast_loop_worker.context.engine import ContextSettings
from holdfast_shared.agents import builtin_agents
from holdfast_shared.errors import ErrorCode
from holdfast_shared.providers import ProviderError
from holdfast_shared.tools import BUILTIN_TOOLS

GENERAL = builtin_agents()["general"]
SKILLS_IN_FULL = "\n\n# Skills\n\n" + "\n".join(
    f"- **skill-{i}**: " + "what this skill is for, at length. " * 8 for i in range(12)
)
SKILLS_BY_NAME = "\n\n# Skills\n\nYour skills: " + ", ".join(f"skill-{i}" for i in range(12))


def sections(**over: object) -> Sections:
    base: dict[str, object] = {
        "system_prompt": GENERAL.system_prompt + SKILLS_IN_FULL,
        "soul": "",
        "history": (),
        "tools": tuple(GENERAL.tool_specs()),
        "retrieved": tuple(f"memory {i}: " + "a remembered fact " * 10 for i in range(8)),
        "working_memory": {"plan": "step 2 of 3"},
    }
    base.update(over)
    return Sections(**base)  # type: ignore[arg-type]


def test_what_fits_is_left_alone() -> None:
    whole = sections()
    assert budget.trim(whole, budget.fixed_tokens(whole), "brief") == whole


def test_memories_go_first_then_skills_by_name_then_tool_descriptions() -> None:
    whole = sections()
    brief = GENERAL.system_prompt + SKILLS_BY_NAME
    size = budget.fixed_tokens(whole)

    fewer = budget.trim(whole, size - 100, brief)
    assert 0 < len(fewer.retrieved) < len(whole.retrieved)
    assert fewer.system_prompt == whole.system_prompt and fewer.tools == whole.tools

    named = budget.trim(whole, budget.fixed_tokens(sections(retrieved=())) - 100, brief)
    assert named.retrieved == ()
    assert named.system_prompt == brief
    assert named.tools == whole.tools
    assert named.working_memory == whole.working_memory  # the model's own notes stay

    least = budget.smallest(whole, brief)
    assert [t.name for t in least.tools] == [t.name for t in whole.tools]
    assert all(t.description == "" for t in least.tools)
    # Parameters stay, their own descriptions go.
    bash = next(t for t in least.tools if t.name == "bash")
    assert "command" in bash.input_schema["properties"]
    assert "description" not in bash.input_schema["properties"]["command"]
    assert budget.fixed_tokens(least) < size // 2


def test_a_short_description_is_the_first_sentence() -> None:
    assert budget.short_description("Run a command. It may take long.") == "Run a command."
    assert budget.short_description("no stop " * 40).endswith("…")
    assert len(budget.short_description("no stop " * 40)) == 160
    schema = {
        "type": "object",
        "description": "x",
        "properties": {"description": {"type": "string", "description": "y"}},
    }
    assert budget.without_descriptions(schema) == {
        "type": "object",
        "properties": {"description": {"type": "string"}},
    }


@pytest.mark.parametrize(
    ("window", "prompt", "wanted", "expected"),
    [
        (200_000, 10_000, 4096, 4096),  # room to spare: the setting
        (2048, 1200, 4096, 745),  # what the window leaves (5 % kept free)
        (2048, 1900, 4096, 256),  # never below a useful answer
        (2048, 1900, 128, 128),  # nor above the setting
    ],
)
def test_max_tokens_fits_what_the_window_leaves(
    window: int, prompt: int, wanted: int, expected: int
) -> None:
    assert budget.output_tokens(window, prompt, wanted) == expected


def test_the_output_limit_is_per_agent_then_per_model_then_global() -> None:
    settings = ContextSettings(
        window=None,
        threshold=0.75,
        compaction_model=None,
        tool_result_chars=20_000,
        max_output_tokens=2000,
        model_max_output_tokens={"openai:gemma": 700, "llama": 800},
        agent_max_output_tokens={"writer": 900},
    )
    assert settings.output_limit("writer", "openai", "gemma") == 900
    assert settings.output_limit("coder", "openai", "gemma") == 700
    assert settings.output_limit("coder", "ollama", "llama") == 800
    assert settings.output_limit("coder", "anthropic", "claude-x") == 2000


def test_a_model_whose_window_holds_no_agent_is_unfit() -> None:
    tools = tuple(GENERAL.tool_specs())
    assert budget.unfit_reason("m", 2048, 0.75, GENERAL.system_prompt, tools) is None
    why = budget.unfit_reason("m", 1024, 0.75, GENERAL.system_prompt, tools)
    assert why is not None and "1024 tokens" in why and "too small" in why


def _overflow(message: str, *, suspected: bool = False) -> ProviderError:
    details = {"suspected_overflow": True} if suspected else {}
    return ProviderError(ErrorCode.CONTEXT_OVERFLOW, message, details=details)


@pytest.mark.parametrize(
    ("message", "window"),
    [
        ("Requested tokens (2087) exceed context window of 2048", 2048),
        ("the request exceeds the available context size (4096 tokens), try increasing it", 4096),
        ("This model's maximum context length is 8192 tokens. However, you requested 9000", 8192),
        ("input length exceeds the context length (n_ctx=2048)", 2048),
        ("context shift is disabled", None),
    ],
)
def test_an_overflow_names_its_window_when_the_provider_does(
    message: str, window: int | None
) -> None:
    found = budget.overflow_of(_overflow(message), 3000)
    assert found == budget.Overflow(3000, window, suspected=False)


def test_a_cut_stream_is_an_overflow_only_on_a_prompt_that_can_fill_a_window() -> None:
    cut = _overflow("the stream ended", suspected=True)
    assert budget.overflow_of(cut, 500) is None
    assert budget.overflow_of(cut, 2100) == budget.Overflow(2100, None, suspected=True)
    other = ProviderError(ErrorCode.LLM_PROVIDER_ERROR, "maximum context length is 2048")
    assert budget.overflow_of(other, 3000) is None


def test_the_window_learned_from_an_overflow() -> None:
    unknown = tokens.UNKNOWN_WINDOW
    assert budget.learned_window(budget.Overflow(2100, None, True), unknown) == 1995
    assert budget.learned_window(budget.Overflow(2100, 2048, False), unknown) == 2048
    # Never below the smallest window, never above what is known already.
    assert budget.learned_window(budget.Overflow(600, None, True), unknown) == 1024
    assert budget.learned_window(budget.Overflow(9000, 8192, False), 4096) == 4096


def test_builtin_tools_keep_their_names_trimmed() -> None:
    trimmed = budget.smallest(sections(tools=tuple(BUILTIN_TOOLS)))
    assert {t.name for t in trimmed.tools} == {t.name for t in BUILTIN_TOOLS}
