"""The context engine's pure parts: assembly, token accounting, the compaction cut."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
from holdfast_loop_worker.context import tokens
from holdfast_loop_worker.context.assembly import Sections, Summary, assemble, visible
from holdfast_loop_worker.context.compaction import (
    SUMMARY_PROMPT,
    echoes_instructions,
    plan,
    summarize,
    transcript,
)
from holdfast_loop_worker.context.working_memory import Change, parse_change
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    ModelRequest,
    TextChunk,
)
from holdfast_shared.tools import BUILTIN_TOOLS


def conversation(turns: int, *, tools_every: int = 3, seed: int = 7) -> list[ChatMessage]:
    """A stored task: user message, then (tool use, tool result)* pairs, then an answer."""
    rng = random.Random(seed)
    out: list[ChatMessage] = []
    next_id = 1

    def add(role: str, blocks: list[dict[str, object]], turn: str, position: int) -> None:
        nonlocal next_id
        out.append(ChatMessage(role, tuple(blocks), turn, id=next_id, position=position))
        next_id += 1

    for t in range(turns):
        turn = f"turn_{t:04d}"
        add(
            "user",
            [{"type": "text", "text": f"message {t}: " + "words " * rng.randint(5, 40)}],
            turn,
            0,
        )
        position = 1
        for c in range(rng.randint(0, 2) if t % tools_every == 0 else 0):
            call = f"call_{t}_{c}"
            add(
                "assistant",
                [{"type": "tool_use", "id": call, "name": "list_dir", "input": {"path": "."}}],
                turn,
                position,
            )
            add(
                "user",
                [{"type": "tool_result", "tool_use_id": call, "output": {"entries": ["a"] * 30}}],
                turn,
                position + 1,
            )
            position += 2
        add("assistant", [{"type": "text", "text": "answer " * rng.randint(5, 60)}], turn, position)
    return out


def pairs_intact(view: list[ChatMessage]) -> bool:
    calls = {b["id"] for m in view for b in m.blocks if b.get("type") == "tool_use"}
    results = {b["tool_use_id"] for m in view for b in m.blocks if b.get("type") == "tool_result"}
    return calls == results


def test_sections_land_in_the_request_in_order() -> None:
    history = conversation(3)
    built = assemble(
        Sections(
            system_prompt="You are the agent.",
            soul="The user likes brevity.",
            history=history,
            working_memory={"plan": "step 2"},
            retrieved=["the user's cat is Tom"],
            tools=BUILTIN_TOOLS,
        ),
        model="scripted",
        provider="scripted",
        cache_key="tenant:task",
    )
    request = built.request
    assert request.system == "You are the agent."
    assert request.soul == "The user likes brevity."
    assert request.notes.index("plan: step 2") < request.notes.index("Tom")
    assert request.messages == tuple(history)
    assert request.tools == BUILTIN_TOOLS and request.cache_key == "tenant:task"
    assert built.tokens > built.fixed_tokens > 0


def test_a_long_tool_result_enters_as_head_and_tail() -> None:
    big = {"type": "tool_result", "tool_use_id": "c", "output": "x" * 50_000 + "THE END"}
    history = [
        ChatMessage("user", ({"type": "text", "text": "go"},), "t", id=1),
        ChatMessage(
            "assistant",
            ({"type": "tool_use", "id": "c", "name": "bash", "input": {}},),
            "t",
            id=2,
            position=1,
        ),
        ChatMessage("user", (big,), "t", id=3, position=2),
    ]
    built = assemble(
        Sections("s", "", history), model="m", provider="scripted", tool_result_chars=3000
    )
    output = built.request.messages[-1].blocks[0]["output"]
    assert len(output) < 3500 and output.endswith("THE END") and "left out of the context" in output
    assert history[2].blocks[0]["output"].endswith("THE END")  # the stored message is untouched


def test_a_summary_replaces_what_it_covers_and_a_cut_turn_keeps_its_opener() -> None:
    history = conversation(10, tools_every=1)
    # A summary ending inside a turn (the opener is covered, the turn goes on).
    inside = next(
        m for m in history if m.role == "user" and m.position > 0 and m.turn_id == "turn_0008"
    )
    view = visible(history, Summary(inside.id, "earlier"))
    assert view[0].role == "user" and view[0].position == 0 and view[0].turn_id == "turn_0008"
    assert view[1].role == "assistant" and view[1].id > inside.id
    built = assemble(
        Sections("s", "", history, summary=Summary(inside.id, "earlier")),
        model="m",
        provider="scripted",
    )
    assert "earlier" in built.request.soul and "not by the user" in built.request.soul


@pytest.mark.parametrize("keep", [0, 50, 200, 800, 3000, 10**6])
def test_the_cut_never_splits_a_tool_use_from_its_result(keep: int) -> None:
    history = conversation(60, tools_every=1)
    summary = None
    for _ in range(6):  # compact again and again, as a long task does
        view = visible(history, summary)
        cut = plan(
            view, keep_tokens=keep, summarized_through=summary.last_message_id if summary else 0
        )
        if cut is None:
            break
        summary = Summary(cut.last_message_id, "s")
        kept = visible(history, summary)
        assert kept[0].role == "user"
        assert pairs_intact(kept), "a tool result lost its call, or a call its result"
        assert all(m.id > cut.last_message_id for m in kept[1:])


def test_the_cut_keeps_the_newest_messages_within_budget() -> None:
    history = conversation(80)
    cut = plan(history, keep_tokens=1000)
    assert cut is not None
    kept = history[len(history) - cut.kept :]
    assert sum(tokens.message_tokens(m) for m in kept) <= 1000
    assert kept[-1] is history[-1]
    assert "User: message 0" in transcript(cut.messages)[0]


def test_windows_and_calibration() -> None:
    assert tokens.context_window("claude-sonnet-4-5") == 200_000
    assert tokens.context_window("gpt-4o-mini") == 128_000
    assert tokens.context_window("gemini-2.5-flash") == 1_048_576
    assert tokens.context_window("some-local-model") == tokens.UNKNOWN_WINDOW
    assert tokens.context_window("claude-sonnet-4-5", override=4000) == 4000
    c = 1.0
    for _ in range(10):
        c = tokens.recalibrate(c, estimate=1000, reported=1300)
    assert 1.29 < c < 1.31
    assert tokens.recalibrate(c, estimate=1000, reported=0) == c  # nothing reported


def test_working_memory_changes_are_checked() -> None:
    assert parse_change({"action": "set", "key": "k", "value": "v"}, {}) == Change("k", "v")
    assert parse_change({"action": "delete", "key": "k"}, {"k": "v"}) == Change("k", None)
    assert "action" in str(parse_change({"action": "drop", "key": "k"}, {}))
    assert "value" in str(parse_change({"action": "set", "key": "k"}, {}))
    full = {f"k{i}": "v" for i in range(100)}
    assert "at most 100 keys" in str(
        parse_change({"action": "set", "key": "new", "value": "v"}, full)
    )


class _Echoing:
    """A model that answers the summary call with its instructions, as Gemma 3
    270M did under llama-cpp-python's gemma format (the system prompt folded
    into the user message)."""

    name = "echoing"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        yield BlockStart(0, "text")
        yield TextChunk(0, request.system + "\nThe conversation continued: ...")
        yield BlockStop(0)
        yield Finish("end_turn")


async def test_a_summary_that_repeats_its_instructions_is_extracted_instead() -> None:
    messages = [
        ChatMessage("user", ({"type": "text", "text": "Plan the trip to Lisbon in May."},)),
        ChatMessage("assistant", ({"type": "text", "text": "Booked the 9:40 train."},)),
    ]
    made = await summarize(_Echoing(), "tiny", None, messages, window=2048, max_tokens=256)
    assert not echoes_instructions(made.text), made.text
    assert "Lisbon" in made.text and "9:40 train" in made.text
    assert echoes_instructions(SUMMARY_PROMPT)
