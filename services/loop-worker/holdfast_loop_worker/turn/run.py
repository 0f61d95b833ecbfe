"""The conductor: claim a turn, drive its steps, and map how it stopped to its ending.

The steps live in their own modules and take the turn's handle
(``handle.py``): ``model_step``, ``tool_step`` (with ``hitl``), ``resume``,
``parking``, ``ending``; ``start`` fills the handle in before the first. How
a run stops is decided in one place, :data:`_ENDINGS`: an exception becomes
an ``ending.Outcome``, which :meth:`TurnRunner._settle` carries out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from holdfast_shared.agents import AgentNotFound
from holdfast_shared.db.models import Turn
from holdfast_shared.errors import ErrorCode, Parked, StepInterrupted, Superseded
from holdfast_shared.eventlog import next_epoch
from holdfast_shared.jobs import TurnJob
from holdfast_shared.observability import metrics
from holdfast_shared.providers import ProviderError, UnknownModel

# Modules, not their functions: the bench times the steps by wrapping them there.
import holdfast_loop_worker.turn.ending as ending
import holdfast_loop_worker.turn.model_step as model_step
import holdfast_loop_worker.turn.parking as parking
import holdfast_loop_worker.turn.result as result
import holdfast_loop_worker.turn.resume as resume
import holdfast_loop_worker.turn.start as start
import holdfast_loop_worker.turn.tool_step as tool_step
from holdfast_loop_worker import executions
from holdfast_loop_worker.stopping import TurnStop
from holdfast_loop_worker.turn.ending import Cancel, Fail, HandBack, Outcome, Park, Pause, Reraise
from holdfast_loop_worker.turn.handle import TurnHandle
from holdfast_loop_worker.turn.live import LiveTurn, TurnContext

log = logging.getLogger(__name__)


def _deadline(_: TimeoutError, turn: TurnHandle, deadline_seconds: float) -> Outcome:
    if (run := turn.execution) is not None and run.budget_is_execution:
        return Fail(ErrorCode.EXECUTION_MAX_DURATION, run.deadline_message(), close_blocks=True)
    message = f"the turn ran past HOLDFAST_TURN_DEADLINE_SECONDS ({deadline_seconds:g})"
    return Fail(ErrorCode.DEADLINE_EXCEEDED, message, close_blocks=True)


_STOPS: dict[str, Outcome] = {"cancel": Cancel(), "handoff": HandBack(), "pause": Pause(True)}


def _stopped(_: asyncio.CancelledError, turn: TurnHandle, __: float) -> Outcome:
    # Which stop cancelled the run (stopping.py); None: a cancel from outside wins.
    return _STOPS.get(turn.stop.consume() or "", Reraise())


# How a run that raised ends, first match wins. Anything else (not an
# Exception: KeyboardInterrupt, GeneratorExit) is re-raised.
_Kind = type[BaseException] | tuple[type[BaseException], ...]
_ENDINGS: tuple[tuple[_Kind, Callable[..., Outcome]], ...] = (
    (Parked, lambda exc, turn, _: Park(exc.request_id)),
    (executions.PauseRequested, lambda *_: Pause(cut=False)),
    (TimeoutError, _deadline),
    (asyncio.CancelledError, _stopped),
    (Superseded, lambda *_: Reraise()),
    (StepInterrupted, lambda exc, *_: Fail.of(exc.error, store=exc.content)),
    (ProviderError, lambda exc, *_: Fail.of(exc)),
    (UnknownModel, lambda exc, *_: Fail(ErrorCode.UNKNOWN_MODEL, str(exc))),
    # A custom agent deleted before this (resumed) turn could read it.
    (AgentNotFound, lambda exc, *_: Fail.of(exc)),
    (Exception, lambda exc, turn, _: ending.unexpected(exc, turn)),
)


def outcome_of(exc: BaseException, turn: TurnHandle, deadline_seconds: float) -> Outcome:
    """How a run that raised ``exc`` ends (:data:`_ENDINGS`)."""
    for kind, outcome in _ENDINGS:
        if isinstance(exc, kind):
            return outcome(exc, turn, deadline_seconds)
    return Reraise()


class TurnRunner:
    """Runs (or continues) one turn until it ends, parks or is handed back."""

    def __init__(self, ctx: TurnContext, job: TurnJob, *, resume_reason: str | None) -> None:
        self.ctx, self.job = ctx, job
        self.resume_reason = resume_reason
        self.handle = LiveTurn(ctx, job)

    @property
    def stop(self) -> TurnStop:
        """Stops requested from outside (cancel, hand-back, pause): see stopping.py."""
        return self.handle.stop

    async def run(self) -> str:
        """``completed``, ``errored``, ``cancelled``, ``parked``, ``paused``, ``handed_back``,
        ``skipped`` (it is over), ``busy`` (another worker holds it) or
        ``superseded`` (another worker took it over while this one stalled)."""
        row = await start.load_turn(self.handle)
        if row is None:
            return "skipped"
        ctx, leases, turn_id = self.ctx, self.ctx.leases, self.job.turn_id
        if not await leases.claim(turn_id) and not await leases.claim_after_lapse(
            turn_id, row.lease_until
        ):
            # Another worker holds it and renews it: leave the job pending; it is
            # offered again once its lease runs out.
            return "busy"
        metrics.lease_claimed(row.lease_owner, leases.owner)
        # From here on, a worker that stalled past its lease and wakes up
        # finds its appends refused (fenced) instead of writing over ours.
        self.handle.emitter.epoch = await next_epoch(ctx.redis, ctx.keys, self.job.task_id)
        try:
            return await self._run_claimed(row)
        except Superseded:
            log.warning("turn %s was taken over by another worker; stopping", turn_id)
            return "superseded"

    async def _run_claimed(self, row: Turn) -> str:
        turn, ctx = self.handle, self.ctx
        resumed = await start.begin(turn, row, self.resume_reason)
        if not resumed and start.state_expired(turn, row):
            return await ending.state_expired(turn)
        try:
            if await turn.cancel_requested():
                return await ending.cancelled(turn)
            if turn.resuming:
                await resume.announce_resume(turn, self.resume_reason)
                if turn.seen.terminal:
                    return await ending.already_ended(turn)
            async with asyncio.timeout(start.budget(turn)):
                stop_reason = await self._drive()
        except BaseException as exc:
            outcome = outcome_of(exc, turn, ctx.deadline_seconds)
            if isinstance(outcome, Reraise):
                raise
            return await self._settle(outcome)
        return await ending.completed(turn, stop_reason)

    async def _settle(self, outcome: Outcome) -> str:
        """Carry out how the run stopped (:func:`outcome_of`)."""
        turn = self.handle
        match outcome:
            case Park(request_id=request_id):
                return await parking.park(turn, request_id)
            case Pause(cut=cut):
                return await executions.park_paused(turn, self.ctx, cut=cut)
            case HandBack():
                return await parking.hand_back(turn)
            case Cancel():
                await model_step.keep_cut_off(turn)
                return await ending.cancelled(turn)
            case Fail():
                if outcome.close_blocks:
                    await model_step.close_open_blocks(turn)
                if outcome.store is not None:
                    await turn.store(turn.message("assistant", outcome.store))
                return await ending.failed(turn, outcome.code, outcome.message, outcome.details)
        raise AssertionError(f"no ending for {outcome!r}")

    async def _drive(self) -> str:
        turn, ctx = self.handle, self.ctx
        choice = await start.resolve(turn)
        while True:
            # A step boundary: an execution may pause or checkpoint here.
            await executions.at_boundary(turn, ctx)
            state = turn.state
            if state.stage == "final":
                result.conclude(turn)  # OUTPUT_INVALID when the answer stayed invalid
                return state.stop_reason or "end_turn"
            if state.stage == "tools":
                await tool_step.run_tools(turn)
                continue
            if state.iteration >= ctx.max_iterations:
                raise ProviderError(
                    ErrorCode.MAX_ITERATIONS,
                    f"the turn reached HOLDFAST_MAX_ITERATIONS ({ctx.max_iterations})",
                )
            # The iteration boundary: messages steered into the turn join it here.
            await model_step.take_steers(turn)
            await model_step.model_step(turn, choice)
