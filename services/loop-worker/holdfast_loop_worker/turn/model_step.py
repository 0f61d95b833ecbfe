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
from holdfast_shared.events import TurnResumed, UserMessage
from holdfast_shared.providers import ModelChoice, ModelEvent, ProviderError, UsageReport
from holdfast_shared.providers.calls import stream_with_retries

import holdfast_loop_worker.turn.result as result
from holdfast_loop_worker.blocks import Block, StreamBlocks
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.context.budget import overflow_of
from holdfast_loop_worker.context.tokens import (
    block_tokens,
    calibrated,
    plausible,
    recalibrate,
)
from holdfast_loop_worker.steering import taken_in
from holdfast_loop_worker.turn.ending import ESTIMATED_CALLS, usage_so_far
from holdfast_loop_worker.turn.handle import ModelTurn, TurnHandle, cut_by_pause
from holdfast_loop_worker.turn_state import PendingCall

log = logging.getLogger(__name__)


# Compactions after an overflow within one step, while each makes the prompt
# smaller: a window only guessed (a stream cut before any output) may take more
# than one guess.
_OVERFLOW_ROUNDS = 3
# A "length" stop with less output than this share of the ``max_tokens`` asked
# was the server's window filling up, not the limit we set (llama.cpp's server
# trims ``max_tokens`` to what its window leaves).
_SHORT_OF_LIMIT = 0.5


async def model_step(turn: ModelTurn, choice: ModelChoice) -> None:
    """One model call and its snapshot: the turn's next stage is its tools or its end."""
    state = turn.state
    # The step holds its endpoint throughout, its compaction's calls and an
    # overflow's retries included: the learning centre must not take a local
    # server between them (holdfast_shared.endpoint_calls).
    async with turn.calling_model(choice):
        blocks, stop_reason = await _answer(turn, choice)
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
        # An output schema: the answer is checked now, and a correction asked
        # for (back to stage "model") commits with this call.
        if (asked := result.judge(turn, blocks)) is not None:
            await turn.snapshot("model_call", message=message, statements=[asked])
            return
    await turn.snapshot("model_call", message=message)


async def _answer(turn: ModelTurn, choice: ModelChoice) -> tuple[list[Block], str]:
    """The call's blocks and stop reason. A prompt the provider finds too long
    teaches the window and is compacted harder, then sent again."""
    prepared = await turn.prepare(choice)
    rounds = 0
    while True:
        try:
            blocks, stop_reason = await _call(turn, choice, prepared)
            break
        except ProviderError as exc:
            prompt = calibrated(prepared.tokens, turn.state.calibration)
            overflow = overflow_of(exc, prompt, turn.largest_answered(choice))
            if overflow is None:
                if exc.code != ErrorCode.CONTEXT_OVERFLOW or not (exc.details or {}).get(
                    "suspected_overflow"
                ):
                    raise
                # A stream cut before any output on a prompt too short to fill
                # any window, or no bigger than one the model answered: not
                # an overflow, a call to make again.
                blocks, stop_reason = await _call(turn, choice, prepared)
                break
            rounds += 1
            if rounds > _OVERFLOW_ROUNDS:
                raise
            log.warning("turn %s: the provider found the context too long", turn.job.turn_id)
            smaller = await turn.prepare(choice, overflow=overflow)
            if smaller.tokens >= prepared.tokens:
                raise  # nothing left to compact: the turn fails with the provider's error
            prepared = smaller
    prompt = calibrated(prepared.tokens, turn.state.calibration)
    turn.prompt_answered(choice, prompt)
    output = sum(block_tokens(b.to_content()) for b in blocks)
    if stop_reason == "max_tokens" and output < prepared.request.max_tokens * _SHORT_OF_LIMIT:
        # The next prompt is judged against what this one and its answer filled.
        turn.window_filled(choice, prompt + output)
    return blocks, stop_reason


async def _call(
    turn: ModelTurn, choice: ModelChoice, prepared: Assembled
) -> tuple[list[Block], str]:
    """One model call; its reported prompt size calibrates the next estimates."""
    call = _ShownCall(turn, prepared.tokens)
    stream = stream_with_retries(
        choice.provider,
        prepared.request,
        attempts=turn.retry_attempts,
        on_restart=call.take_back,
        observe=True,
    )
    # A pause may cut a model call short (executions.interrupt_for_pause).
    with cut_by_pause(turn):
        # The endpoint is held by model_step around every call of the step.
        blocks, stop_reason = await call.run(stream)
    turn.state.calibration = recalibrate(
        turn.state.calibration, prepared.tokens, call.prompt_tokens
    )
    return blocks, stop_reason


class _ShownCall:
    """One model call as the client sees it, attempt after attempt.

    Each event is shown as it comes. An attempt that breaks off after output
    and is retried (``stream_with_retries``' ``on_restart``) is taken back:
    its open blocks closed, then ``turn_resumed`` (``reason: "model_retry"``)
    names its events (``discard_from_seq``..``discard_to_seq``), as a resume
    on another worker does, so a client shows the retried attempt's output
    once, never both.

    Each attempt's usage is counted once it ends (:meth:`_settle`).
    """

    def __init__(self, turn: ModelTurn, estimated_prompt: int) -> None:
        self.turn = turn
        self.estimated_prompt = estimated_prompt
        # The prompt's size as reported, when believed: it calibrates the estimates.
        self.prompt_tokens = 0
        self.report: UsageReport | None = None
        # The task's last seq before this attempt's first shown event.
        self.before: int | None = None
        # Kept on the handle while it streams: a cancel or deadline closes what it left open.
        turn.stream = self.blocks = StreamBlocks()

    async def run(self, stream: AsyncIterator[ModelEvent]) -> tuple[list[Block], str]:
        turn = self.turn
        try:
            async for item in stream:
                if isinstance(item, UsageReport):
                    self.report = item if self.report is None else _summed(self.report, item)
                    continue
                shown = self.blocks.take(item)
                if shown and self.before is None:
                    self.before = await turn.logged_seq()
                for event in shown:
                    await turn.emit(event)
        except ProviderError as exc:
            if not self.blocks.by_index:
                raise
            self._settle(completed=False)
            await close_open_blocks(turn)
            raise StepInterrupted(exc, partial_content(turn, self.blocks)) from exc
        except BaseException:
            # A cancel, pause, deadline or shutdown cut the call off.
            self._settle(completed=False)
            raise
        self._settle(completed=True)
        turn.stream = None
        return self.blocks.blocks(), self.blocks.stop_reason

    async def take_back(self, exc: ProviderError) -> None:
        """The attempt broke off after output and will be made again: its output
        is marked discarded (it was billed, so it stays counted)."""
        turn = self.turn
        log.warning("turn %s: model call retried after partial output: %s", turn.job.turn_id, exc)
        self._settle(completed=False)
        await close_open_blocks(turn)
        if self.before is not None:
            last = await turn.logged_seq()
            if last > self.before:
                await turn.emit(
                    TurnResumed(
                        reason="model_retry",
                        discard_from_seq=self.before + 1,
                        discard_to_seq=last,
                    )
                )
        turn.stream = self.blocks = StreamBlocks()
        self.before = None

    def _settle(self, *, completed: bool) -> None:
        """Count the attempt's usage: as reported when the report is plausible
        (``tokens.plausible``); else from our own estimates (the prompt as
        assembled, the output as shown), marked estimated — a server that
        reports none (llama.cpp) or a constant, or a stream cut off before its
        report came (providers report at the end). An attempt cut off before
        any output is not counted: it may never have reached the model."""
        report, self.report = self.report, None
        state = self.turn.state
        if report is not None and plausible(self.estimated_prompt, _prompt_of(report)):
            self.prompt_tokens = _prompt_of(report)
            state.add_usage(
                {
                    "input_tokens": report.input_tokens,
                    "output_tokens": report.output_tokens,
                    "cache_creation_input_tokens": report.cache_creation_input_tokens,
                    "cache_read_input_tokens": report.cache_read_input_tokens,
                    "reasoning_tokens": report.reasoning_tokens,
                }
            )
            return
        if not completed and not self.blocks.by_index:
            return
        if report is not None:
            log.warning(
                "turn %s: usage %s is implausible for a prompt estimated at %d tokens: estimated",
                self.turn.job.turn_id,
                report,
                self.estimated_prompt,
            )
        state.add_usage(
            {
                "input_tokens": calibrated(self.estimated_prompt, state.calibration),
                "output_tokens": sum(block_tokens(b) for b in self.blocks.contents()),
                ESTIMATED_CALLS: 1,
            }
        )


def _prompt_of(report: UsageReport) -> int:
    return report.input_tokens + report.cache_creation_input_tokens + report.cache_read_input_tokens


def _summed(a: UsageReport, b: UsageReport) -> UsageReport:
    return UsageReport(*(getattr(a, f) + getattr(b, f) for f in UsageReport.__dataclass_fields__))


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
