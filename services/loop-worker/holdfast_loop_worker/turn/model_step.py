"""The model step: one model call, its stream shown to the client block by block.

The blocks are built by ``blocks.StreamBlocks``, the dispatcher the provider
tests use too (``blocks.assemble``), so the loop and those tests build a call's
blocks alike. Messages steered into the turn join it at the iteration boundary,
just before the call (:func:`take_steers`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from holdfast_shared.errors import ErrorCode, StepInterrupted
from holdfast_shared.events import UserMessage
from holdfast_shared.providers import ModelChoice, ModelEvent, ProviderError, UsageReport
from holdfast_shared.providers.retry import stream_with_retries

from holdfast_loop_worker.blocks import Block, StreamBlocks
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.context.tokens import block_tokens, calibrated, recalibrate
from holdfast_loop_worker.modelcalls import observed_model_call
from holdfast_loop_worker.steering import taken_in
from holdfast_loop_worker.turn.ending import usage_so_far
from holdfast_loop_worker.turn.handle import ModelTurn, TurnHandle
from holdfast_loop_worker.turn_state import PendingCall

log = logging.getLogger(__name__)


async def model_step(turn: ModelTurn, choice: ModelChoice) -> None:
    """One model call and its snapshot: the turn's next stage is its tools or its end."""
    state = turn.state
    prepared = await turn.prepare(choice)
    try:
        blocks, stop_reason = await _call(turn, choice, prepared)
    except ProviderError as exc:
        if exc.code != ErrorCode.CONTEXT_OVERFLOW:
            raise
        # Our estimate was short of the provider's count: compact harder, once.
        log.warning("turn %s: the provider found the context too long", turn.job.turn_id)
        smaller = await turn.prepare(choice, harder=True)
        if smaller.tokens >= prepared.tokens:
            raise  # nothing left to compact: the turn fails with the provider's error
        blocks, stop_reason = await _call(turn, choice, smaller)
    await turn.emit(usage_so_far(turn, record=True))
    content = {
        "blocks": [b.to_content() for b in blocks],
        "stop_reason": stop_reason,
        "provider": choice.provider.name,
    }
    message = turn.message("assistant", content)
    state.iteration += 1
    calls = [b for b in blocks if b.block_type == "tool_use"]
    if stop_reason == "tool_use" and calls:
        state.stage = "tools"
        state.pending = [
            PendingCall(b.tool_call_id or "", b.tool_name or "", b.tool_input()) for b in calls
        ]
    else:
        state.stage = "final"
        state.stop_reason = stop_reason
    await turn.snapshot("model_call", message=message)


async def _call(
    turn: ModelTurn, choice: ModelChoice, prepared: Assembled
) -> tuple[list[Block], str]:
    """One model call; its reported prompt size calibrates the next estimates."""
    stream = observed_model_call(
        choice.provider.name,
        choice.model,
        stream_with_retries(choice.provider, prepared.request, attempts=turn.retry_attempts),
    )
    # A pause may cut a model call short (executions.interrupt_for_pause): the
    # flag is set with no await between it and the stream.
    turn.streaming = True
    if turn.pause_pending:
        turn.stop.request("pause")
    try:
        blocks, stop_reason, prompt_tokens = await _stream(turn, stream, prepared.tokens)
    finally:
        turn.streaming = False
    turn.state.calibration = recalibrate(turn.state.calibration, prepared.tokens, prompt_tokens)
    return blocks, stop_reason


async def _stream(
    turn: ModelTurn, stream: AsyncIterator[ModelEvent], estimated_prompt: int
) -> tuple[list[Block], str, int]:
    """The call's blocks, stop reason and prompt size, each event shown as it comes."""
    # Kept on the handle while it streams: a cancel or deadline closes what it left open.
    turn.stream = blocks = StreamBlocks()
    prompt_tokens = 0
    reported = False
    try:
        async for item in stream:
            if isinstance(item, UsageReport):
                reported = True
                prompt_tokens += (
                    item.input_tokens
                    + item.cache_creation_input_tokens
                    + item.cache_read_input_tokens
                )
                turn.state.add_usage(
                    {
                        "input_tokens": item.input_tokens,
                        "output_tokens": item.output_tokens,
                        "cache_creation_input_tokens": item.cache_creation_input_tokens,
                        "cache_read_input_tokens": item.cache_read_input_tokens,
                        "reasoning_tokens": item.reasoning_tokens,
                    }
                )
                continue
            for shown in blocks.take(item):
                await turn.emit(shown)
    except ProviderError as exc:
        if not blocks.by_index:
            raise
        if not reported:
            _count_cut_off(turn, blocks, estimated_prompt)
        await close_open_blocks(turn)
        raise StepInterrupted(exc, partial_content(turn, blocks)) from exc
    except BaseException:
        # A cancel, pause, deadline or shutdown cut the call off.
        if not reported:
            _count_cut_off(turn, blocks, estimated_prompt)
        raise
    turn.stream = None
    return blocks.blocks(), blocks.stop_reason, prompt_tokens


def _count_cut_off(turn: ModelTurn, blocks: StreamBlocks, estimated_prompt: int) -> None:
    """Providers report a call's usage at the end of its stream: a call cut off
    after it had streamed output is counted from our own estimates (the prompt
    as assembled, the output as shown), or the turn's usage would read 0/0
    after the deltas its client saw. A call cut off before any output is not
    counted (it may never have reached the model)."""
    if not blocks.by_index:
        return
    turn.state.add_usage(
        {
            "input_tokens": calibrated(estimated_prompt, turn.state.calibration),
            "output_tokens": sum(block_tokens(b) for b in blocks.contents()),
        }
    )


def partial_content(turn: TurnHandle, blocks: StreamBlocks) -> dict[str, Any]:
    """The stored content of a model call cut off after ``blocks`` began."""
    return {"blocks": blocks.contents(), "interrupted": True, "provider": turn.provider_name}


async def close_open_blocks(turn: ModelTurn) -> StreamBlocks | None:
    """Close what a cut-off model call left open, so the client's view is whole;
    the call's blocks, if one was cut off."""
    cut, turn.stream = turn.stream, None
    if cut is not None:
        for shown in cut.close_open():
            await turn.emit(shown)
    return cut


async def keep_cut_off(turn: ModelTurn) -> None:
    """A model call cancelled mid-stream: its open blocks closed, and what the
    model had said is stored, so the conversation goes on from it."""
    cut = await close_open_blocks(turn)
    if cut is not None and cut.by_index:
        await turn.store(turn.message("assistant", partial_content(turn, cut)))


async def take_steers(turn: ModelTurn) -> None:
    """Messages sent with ``on_busy: "steer"`` become this turn's (steering.py):
    logged, then stored with the step's snapshot."""
    steers = await turn.pending_steers()
    if not steers:
        return
    for steer in steers:
        if steer.message_id not in turn.seen.steers:
            await turn.emit(UserMessage(text=steer.text, message_id=steer.message_id))
            turn.seen.steers.add(steer.message_id)
    stored = [turn.message("user", steer.content) for steer in steers]
    await turn.snapshot("steer", statements=[*stored, taken_in(steers)])
