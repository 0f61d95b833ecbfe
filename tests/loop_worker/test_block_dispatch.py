"""The one block dispatcher (``blocks.StreamBlocks``): what the model step shows
the client of a call's stream, and what ``blocks.assemble`` stores for the
provider tests — the same blocks."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from holdfast_loop_worker.blocks import StreamBlocks, assemble
from holdfast_loop_worker.turn import model_step
from holdfast_shared.errors import ErrorCode, StepInterrupted
from holdfast_shared.events import (
    ContentBlockStart,
    ContentBlockStop,
    TextDelta,
    ThinkingDelta,
    ToolCall,
)
from holdfast_shared.providers import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    ProviderError,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    UsageReport,
)

from tests.loop_worker.fake_turn import FakeTurn

CALL: list[ModelEvent] = [
    BlockStart(0, "thinking"),
    ThinkingChunk(0, "hm"),
    BlockStop(0, signature="sig"),
    BlockStart(1, "text"),
    TextChunk(1, "Hel"),
    TextChunk(1, "lo"),
    BlockStop(1),
    BlockStart(2, "tool_use", tool_name="bash", tool_call_id="call_1"),
    ToolInputChunk(2, '{"command": '),
    ToolInputChunk(2, '"ls"}'),
    BlockStop(2),
    UsageReport(input_tokens=10, output_tokens=4, cache_read_input_tokens=2),
    Finish("tool_use"),
]


def test_each_event_shows_the_client_its_part() -> None:
    blocks = StreamBlocks()
    shown = [event for item in CALL for event in blocks.take(item)]
    assert shown == [
        ContentBlockStart(block_index=0, block_type="thinking"),
        ThinkingDelta(text="hm"),
        ContentBlockStop(block_index=0, block_type="thinking"),
        ContentBlockStart(block_index=1, block_type="text"),
        TextDelta(text="Hel"),
        TextDelta(text="lo"),
        ContentBlockStop(block_index=1, block_type="text"),
        ContentBlockStart(block_index=2, block_type="tool_use"),
        ContentBlockStop(block_index=2, block_type="tool_use"),
        ToolCall(tool="bash", tool_call_id="call_1", input={"command": "ls"}),
    ]
    assert blocks.stop_reason == "tool_use"
    assert (
        blocks.contents()
        == assemble(CALL)
        == [
            {"type": "thinking", "text": "hm", "signature": "sig"},
            {"type": "text", "text": "Hello"},
            {"type": "tool_use", "id": "call_1", "name": "bash", "input": {"command": "ls"}},
        ]
    )


def test_a_cut_off_call_closes_its_blocks_without_announcing_a_tool() -> None:
    blocks = StreamBlocks()
    for item in CALL[:9]:  # the tool call's input half streamed
        blocks.take(item)
    assert blocks.close_open() == [ContentBlockStop(block_index=2, block_type="tool_use")]
    assert blocks.close_open() == []


async def _stream(
    items: list[ModelEvent], fail: ProviderError | None = None
) -> AsyncIterator[ModelEvent]:
    for item in items:
        yield item
    if fail is not None:
        raise fail


async def test_the_model_step_emits_what_the_dispatcher_shows() -> None:
    turn = FakeTurn()
    call = model_step._ShownCall(turn, 0)
    blocks, stop_reason = await call.run(_stream(CALL))
    prompt_tokens = call.prompt_tokens
    expected = StreamBlocks()
    assert turn.events == [event for item in CALL for event in expected.take(item)]
    assert [b.to_content() for b in blocks] == assemble(CALL)
    assert (stop_reason, prompt_tokens) == ("tool_use", 12)
    assert turn.state.usage["output_tokens"] == 4
    assert turn.stream is None  # the call completed: nothing left to close


async def test_a_stream_broken_after_output_keeps_its_partial_message() -> None:
    turn = FakeTurn()
    reset = ProviderError(ErrorCode.LLM_PROVIDER_ERROR, "connection reset")
    with pytest.raises(StepInterrupted) as raised:
        await model_step._ShownCall(turn, 0).run(_stream(CALL[:5], fail=reset))
    assert turn.events[-1] == ContentBlockStop(block_index=1, block_type="text")
    assert raised.value.content == {
        "blocks": [
            {"type": "thinking", "text": "hm", "signature": "sig"},
            {"type": "text", "text": "Hel"},
        ],
        "interrupted": True,
        "provider": "scripted",
    }


async def test_a_stream_broken_before_output_fails_as_the_provider_said() -> None:
    turn = FakeTurn()
    reset = ProviderError(ErrorCode.LLM_PROVIDER_ERROR, "connection reset")
    with pytest.raises(ProviderError):
        await model_step._ShownCall(turn, 0).run(_stream([], fail=reset))
    assert turn.events == []
