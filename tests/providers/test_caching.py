"""Prompt caching, measured on the wire: stable parts first, breakpoints where they pay.

Each provider sends what changes least first — settings, tools, the system
prompt and soul, the conversation oldest first — and what changes every call
last (the notes), so a call's body starts with the previous call's. The
measure is the one the issue gives: over a task of several turns with tool
calls, from the third turn on, the bytes each request shares with the start
of the previous one, divided by its size, stay at or above 0.9.
"""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import pairwise
from typing import Any

import pytest
from holdfast_shared.agents import DEFAULT_AGENT, builtin_agents
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers.base import ModelRequest
from holdfast_shared.tools import BUILTIN_TOOLS

from tests.providers import fake_anthropic
from tests.providers.apis import ANTHROPIC, GEMINI, OPENAI, Api, assistant, each_api
from tests.providers.streams import SYSTEM, WEATHER, collect, user
from tests.providers.wire import WireServer

pytestmark = pytest.mark.timeout(60)

# The system prompt a task's turns run with when they name no agent.
SYSTEM_PROMPT = builtin_agents()[DEFAULT_AGENT].system_prompt

# A soul as the context engine writes one: who the user is and what the
# agent has learnt about them in earlier tasks.
SOUL = (
    "# About the user\n"
    "Maintains ledgerparse, a small Python library for parsing plain-text ledger files, "
    "alone, on evenings and weekends. Prefers short answers with the command that was run, "
    "uv for tooling, pytest with -q, and commit messages that say why rather than what. "
    "Works in UTC; writes British English.\n\n"
    "# What the agent has learnt\n"
    "- The changelog is CHANGELOG.md, newest entry first, one line per change.\n"
    "- Releases are cut from main after CI passes; tags are vX.Y.Z, annotated.\n"
    "- Do not touch uv.lock by hand; run uv lock when dependencies change.\n"
    "- The test suite must stay under a second; slow tests go behind -m slow.\n"
    "- The user reviews every edit to pyproject.toml before it is committed.\n"
    "- Public functions keep their docstrings in the Google style.\n"
    "- CI runs on Python 3.11 to 3.13; 3.10 support was dropped in 0.3.0.\n"
    "- The parser must accept both tabs and two or more spaces between account and amount.\n"
    "- Commodity symbols may come before or after the amount; both are tested.\n"
    "- Issues are triaged on Sundays; the user likes a summary of open ones then.\n"
)
CACHE_KEY = "task_01JCACHEKEY0000000000000"
BREAKPOINT = {"type": "ephemeral"}


def notes(step: int) -> str:
    return (
        "## Working memory\n"
        f"- step: {step}\n"
        "- goal: release 0.4.2 with the parser fix\n"
        "## Retrieved memory\n"
        "- the user tags releases as vX.Y.Z"
    )


def result(call_id: str, output: str) -> ChatMessage:
    return ChatMessage("user", ({"type": "tool_result", "tool_use_id": call_id, "output": output},))


# --- where the stable parts and the breakpoints go ----------------------------


async def test_anthropic_breakpoints_sit_on_tools_system_soul_and_before_the_notes(
    wire: WireServer,
) -> None:
    provider = ANTHROPIC.connect(wire)
    wire.queue(fake_anthropic.text_reply(["ok"]))
    history = (
        user("Weather in Paris?"),
        ChatMessage(
            "assistant",
            ({"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}},),
        ),
        result("toolu_1", "18°C"),
    )
    request = ModelRequest(
        model=ANTHROPIC.model,
        system=SYSTEM,
        messages=history,
        tools=(WEATHER, *BUILTIN_TOOLS),
        soul=SOUL,
        notes=notes(2),
    )

    await collect(provider.stream(request))
    await provider.aclose()

    body = wire.requests[0].json
    last_tool = f"tools.{len(BUILTIN_TOOLS)}"
    assert fake_anthropic.cache_breakpoints(body) == [
        last_tool,
        "system.0",
        "system.1",
        "messages.2.content.0",
    ]
    assert body["system"] == [
        {"type": "text", "text": SYSTEM, "cache_control": BREAKPOINT},
        {"type": "text", "text": SOUL, "cache_control": BREAKPOINT},
    ]
    # The newest message's breakpoint is on its own content; the notes follow, unmarked.
    assert body["messages"][2]["content"] == [
        {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": "18°C",
            "cache_control": BREAKPOINT,
        },
        {"type": "text", "text": notes(2)},
    ]


async def test_anthropic_without_a_soul_has_three_breakpoints(wire: WireServer) -> None:
    provider = ANTHROPIC.connect(wire)
    wire.queue(fake_anthropic.text_reply(["ok"]))
    request = ModelRequest(
        model=ANTHROPIC.model, system=SYSTEM, messages=(user("Hi"),), tools=(WEATHER,)
    )

    await collect(provider.stream(request))
    await provider.aclose()

    body = wire.requests[0].json
    assert fake_anthropic.cache_breakpoints(body) == ["tools.0", "system.0", "messages.0.content.0"]
    assert [b["text"] for b in body["system"]] == [SYSTEM]


async def test_openai_routes_the_cache_by_the_task_and_puts_the_notes_last(
    wire: WireServer,
) -> None:
    provider = OPENAI.connect(wire)
    wire.queue(OPENAI.text("ok"), OPENAI.text("ok"), OPENAI.text("ok"))
    after_tools = (
        user("Weather?"),
        ChatMessage(
            "assistant",
            ({"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}},),
        ),
        result("call_1", "18°C"),
    )
    base = ModelRequest(model=OPENAI.model, system=SYSTEM, messages=(user("Weather?"),))

    await collect(provider.stream(_with(base, soul=SOUL, notes="N1", cache_key=CACHE_KEY)))
    await collect(provider.stream(_with(base, messages=after_tools, notes="N2")))
    await collect(provider.stream(base))
    await provider.aclose()

    first, second, plain = (r.json for r in wire.requests)
    assert first["prompt_cache_key"] == CACHE_KEY
    assert first["messages"] == [
        {"role": "system", "content": f"{SYSTEM}\n\n{SOUL}"},
        # A string, not a list of parts: llama.cpp's chat templates drop lists (#31).
        {"role": "user", "content": "Weather?\n\nN1"},
    ]
    # After tool messages the notes are a user message of their own.
    assert second["messages"][-2:] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "18°C"},
        {"role": "user", "content": "N2"},
    ]
    assert "prompt_cache_key" not in plain
    assert plain["messages"][-1] == {"role": "user", "content": "Weather?"}


async def test_gemini_system_instruction_is_the_prompt_then_the_soul(wire: WireServer) -> None:
    provider = GEMINI.connect(wire)
    wire.queue(GEMINI.text("ok"))
    request = ModelRequest(
        model=GEMINI.model, system=SYSTEM, messages=(user("Hi"),), soul=SOUL, notes="N"
    )

    await collect(provider.stream(request))
    await provider.aclose()

    body = wire.requests[0].json
    assert [p["text"] for p in body["systemInstruction"]["parts"]] == [SYSTEM, SOUL]
    assert body["contents"] == [{"role": "user", "parts": [{"text": "Hi"}, {"text": "N"}]}]


@each_api
async def test_the_conversation_is_the_last_thing_in_the_body(wire: WireServer, api: Api) -> None:
    provider = api.connect(wire)
    wire.queue(api.text("ok"))
    request = ModelRequest(
        model=api.model, system=SYSTEM, messages=(user("Hi"),), tools=BUILTIN_TOOLS, soul=SOUL
    )

    await collect(provider.stream(request))
    await provider.aclose()

    keys = list(json.loads(wire.requests[0].raw))
    assert keys[-1] == api.conversation, keys
    assert keys.index("tools") < keys.index(api.conversation)


# --- the measure: a task of five turns with tool calls ----------------------

# (the user's message, the tool calls with their outputs, the final answer)
Turn = tuple[str, list[tuple[str, dict[str, Any], str]], str]

LISTING = "\n".join(
    f"{kind} {name}"
    for kind, name in [
        ("d", "src"),
        ("d", "tests"),
        ("f", "README.md"),
        ("f", "CHANGELOG.md"),
        ("f", "pyproject.toml"),
        ("f", "uv.lock"),
    ]
)
README = (
    "# ledgerparse\n\nParse plain-text ledger files into typed transactions.\n\n"
    "## Install\n\n    uv add ledgerparse\n\n## Use\n\n"
    "    from ledgerparse import parse\n    for tx in parse(open('books.ledger')):\n"
    "        print(tx.date, tx.payee, tx.total)\n\n"
    "## Develop\n\n    uv sync\n    uv run pytest -q\n\nReleases follow semantic versioning.\n"
)
PYTEST = (
    "............................................                             [100%]\n"
    "44 passed in 0.61s\n"
)
CHANGELOG = (
    "# Changelog\n\n## 0.4.1\n\n- Accept tabs between amount and commodity.\n\n"
    "## 0.4.0\n\n- Typed postings; `Transaction.total`.\n"
)
TURNS: list[Turn] = [
    (
        "What is in this project?",
        [("list_dir", {"path": "."}, LISTING), ("read_file", {"path": "README.md"}, README)],
        "A small library that parses ledger files; tests under tests/, run with uv.",
    ),
    (
        "Do the tests pass?",
        [("bash", {"command": "uv run pytest -q"}, PYTEST)],
        "Yes: 44 passed.",
    ),
    (
        "Add a changelog entry for the parser fix.",
        [
            ("read_file", {"path": "CHANGELOG.md"}, CHANGELOG),
            (
                "edit_file",
                {
                    "path": "CHANGELOG.md",
                    "old": "## 0.4.1",
                    "new": "## 0.4.2\n\n- Fix.\n\n## 0.4.1",
                },
                "edited CHANGELOG.md (1 replacement)",
            ),
        ],
        "Added 0.4.2 with the parser fix on top of CHANGELOG.md.",
    ),
    (
        "Run the tests again.",
        [("bash", {"command": "uv run pytest -q"}, PYTEST)],
        "Still 44 passed.",
    ),
    (
        "Show me the top of the changelog.",
        [("read_file", {"path": "CHANGELOG.md"}, CHANGELOG.replace("0.4.1", "0.4.2", 1))],
        "It opens with 0.4.2 and the fix.",
    ),
]


async def run_task(api: Api, wire: WireServer) -> list[tuple[int, bytes]]:
    """Every request of the task as the server got it, with its turn number."""
    provider = api.connect(wire)
    history: list[ChatMessage] = []
    sent: list[tuple[int, bytes]] = []
    step = 0
    try:
        for turn, (question, calls, answer) in enumerate(TURNS, 1):
            history.append(user(question))
            for call in [*calls, None]:
                step += 1
                call_id = f"call_{step:02d}"
                if call is None:
                    wire.queue(api.text(answer))
                else:
                    wire.queue(api.tool_call(call_id, call[0], call[1]))
                request = ModelRequest(
                    model=api.model,
                    system=SYSTEM_PROMPT,
                    messages=tuple(history),
                    tools=BUILTIN_TOOLS,
                    soul=SOUL,
                    notes=notes(step),
                    cache_key=CACHE_KEY,
                )
                events = await collect(provider.stream(request))
                sent.append((turn, wire.requests[-1].raw))
                history.append(assistant(events, api.name))
                if call is not None:
                    history.append(result(call_id, call[2]))
    finally:
        await provider.aclose()
    return sent


def shared_prefix(a: bytes, b: bytes) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_ratios(sent: list[tuple[int, bytes]], from_turn: int = 3) -> list[float]:
    """For each request from ``from_turn`` on: its bytes shared with the previous one's start."""
    return [
        shared_prefix(previous, body) / len(body)
        for (_, previous), (turn, body) in pairwise(sent)
        if turn >= from_turn
    ]


@each_api
async def test_from_the_third_turn_each_request_repeats_nine_tenths_of_the_last(
    wire: WireServer, api: Api
) -> None:
    sent = await run_task(api, wire)

    assert len(sent) == sum(len(calls) + 1 for _, calls, _ in TURNS)
    ratios = prefix_ratios(sent)
    print(f"{api.name}: prefix ratios from turn 3: {[round(r, 3) for r in ratios]}")
    assert min(ratios) >= 0.9, ratios
    # What falls out of the prefix is the previous call's tail: its notes, the
    # breakpoint that moved on, closing brackets (and, on OpenAI, the text of a
    # user message that carried the notes as a part and is a plain string now).
    for step, ((_, previous), (_, body)) in enumerate(pairwise(sent), 1):
        lost = len(previous) - shared_prefix(previous, body)
        assert lost <= len(json.dumps(notes(step))) + 128, (step, lost)


def _with(request: ModelRequest, **changes: Any) -> ModelRequest:
    return replace(request, **changes)
