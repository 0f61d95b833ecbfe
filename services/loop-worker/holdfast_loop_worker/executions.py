"""The loop-worker's part of executions (``/v1/execution``): pause, automatic
checkpoints, ``max_duration_seconds`` and retries, at the turn's step boundaries.

The turn's conductor (``turn/run.py``) and ``consumer.py`` call in at a few
points and leave the rest here; every hook gets the turn's handle
(``turn/handle.py``), never the conductor:

* when it claims a turn, :meth:`ExecutionRun.load` — None unless the turn is
  an execution's (one indexed read), and every other hook is then a no-op;
* while it streams a model call, :func:`interrupt_for_pause` (the consumer's
  pause listener): the call is cut off so a pause lands in well under a
  second, not after the model's whole answer;
* at every step boundary (the top of the conductor's loop: after each snapshot,
  and before the first step) :func:`at_boundary`: a pause request for this
  turn (``Keys.pause``, set by the gateway) raises :class:`PauseRequested`,
  and an automatic checkpoint is taken when ``checkpoint_interval_seconds``
  passed since the last one;
* for the deadline, :meth:`ExecutionRun.budget`: the turn's time budget is cut
  to what is left of ``max_duration_seconds`` (active time: a turn's
  ``active_ms`` counts only time it ran, so pauses are excluded);
* where the turn parks on a pause (:func:`park_paused`, like HITL parking:
  snapshot, lock kept, lease released with status ``paused``, no worker
  held) and where it ends (:func:`turn_ended`: the execution's status; or,
  for a failed step with ``retry`` left, a rollback to the last checkpoint
  and a resume after the backoff).

A subagent's turn (its task delegated to by another) pauses the same way,
reached by its parent execution's pause (the gateway sets its request too),
without the rest: it has no execution row, checkpoints or retries.

A paused turn (``turns.status = paused``) is neither claimed (``lease.py``
claims queued, running and parked turns only) nor requeued by ``recovery.py``
(queued and running only): only a resume (the gateway sets it ``running`` and
queues the job) continues it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from holdfast_shared.db.models import Execution
from holdfast_shared.errors import ErrorCode, Superseded, TurnSignal
from holdfast_shared.eventlog import EventLog
from holdfast_shared.events import ErrorEvent
from holdfast_shared.executions import RollbackTarget, roll_back
from holdfast_shared.executions import store as executions
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import Keys
from holdfast_shared.turnlock import TurnLock
from holdfast_shared.workspace_checkpoints.requests import (
    WorkspaceRequestError,
    checkpoint_workspace,
)
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.lease import Leases
from holdfast_loop_worker.toolcalls import ToolCaller
from holdfast_loop_worker.turn_state import Snapshots, TurnState

log = logging.getLogger(__name__)

# Failures a retry cannot help: the execution's own time is up, or the turn's.
_NOT_RETRIED = frozenset({ErrorCode.EXECUTION_MAX_DURATION, ErrorCode.DEADLINE_EXCEEDED})


# What this module uses of the worker's TurnContext (turn/handle.py).
class _Context(Protocol):
    @property
    def sessions(self) -> async_sessionmaker[AsyncSession]: ...
    @property
    def reads(self) -> async_sessionmaker[AsyncSession]: ...
    @property
    def redis(self) -> Redis: ...
    @property
    def keys(self) -> Keys: ...
    @property
    def eventlog(self) -> EventLog: ...
    @property
    def snapshots(self) -> Snapshots: ...
    @property
    def leases(self) -> Leases: ...
    @property
    def lock(self) -> TurnLock: ...
    @property
    def tools(self) -> ToolCaller | None: ...


class TurnHandle(Protocol):
    """The part of the turn's handle (``turn/handle.py``'s ``TurnHandle``) this
    module uses: its public surface only. Named here, not imported, because the
    handle's module imports this one."""

    @property
    def job(self) -> TurnJob: ...
    @property
    def state(self) -> TurnState: ...
    @property
    def execution(self) -> ExecutionRun | None: ...
    @property
    def pausable(self) -> bool: ...
    @property
    def task_name(self) -> str: ...
    async def snapshot(self, reason: str, *, advance: bool = True) -> None: ...
    async def keep_task_while_parked(self) -> None: ...
    async def cancel_requested(self) -> bool: ...
    def active_ms(self) -> int: ...
    async def requeue(self, job: TurnJob) -> None: ...
    def interrupt_for_pause(self) -> None: ...


class _RunsTurn(Protocol):
    """What the consumer holds of a running turn (the conductor)."""

    @property
    def handle(self) -> TurnHandle: ...


class PauseRequested(TurnSignal):
    """The execution was asked to pause: the turn parks at this step boundary."""


@dataclass
class ExecutionRun:
    """What a turn needs to know of its execution, read when it is claimed."""

    execution_id: str
    max_duration_seconds: float | None
    checkpoint_interval_seconds: float | None
    retry_max_attempts: int
    retry_backoff_seconds: float
    last_checkpoint: datetime
    # Set when the turn's time budget is the execution's (not the turn deadline).
    budget_is_execution: bool = False

    @classmethod
    async def load(cls, ctx: _Context, job: TurnJob) -> ExecutionRun | None:
        async with ctx.reads() as session:
            row = await executions.of_task(session, job.task_id)
        if row is None or row.turn_id != job.turn_id:
            return None  # not an execution, or another turn of its task
        config: dict[str, Any] = row.config or {}
        retry: dict[str, Any] = config.get("retry") or {}
        return cls(
            execution_id=row.id,
            max_duration_seconds=config.get("max_duration_seconds"),
            checkpoint_interval_seconds=config.get("checkpoint_interval_seconds"),
            retry_max_attempts=int(retry.get("max_attempts", 0)),
            retry_backoff_seconds=float(retry.get("backoff_seconds", 0)),
            last_checkpoint=row.last_checkpoint_at or row.started_at,
        )

    def budget(self, turn_budget: float, active_ms: int) -> float:
        """The turn's time budget, cut to what is left of ``max_duration_seconds``."""
        if self.max_duration_seconds is None:
            return turn_budget
        left = max(0.0, self.max_duration_seconds - active_ms / 1000)
        self.budget_is_execution = left < turn_budget
        return min(turn_budget, left)

    def deadline_message(self) -> str:
        return (
            f"the execution ran past its max_duration_seconds ({self.max_duration_seconds:g}) "
            "of active time"
        )


async def at_boundary(turn: TurnHandle, ctx: _Context) -> None:
    """Between two steps: pause if asked to, take an automatic checkpoint if due."""
    if not turn.pausable:
        return
    if await ctx.redis.get(ctx.keys.pause(turn.job.task_id)) == turn.job.turn_id:
        raise PauseRequested()
    run = turn.execution
    if run is None:
        return  # a subagent's turn: paused with its parent, never checkpointed
    interval = run.checkpoint_interval_seconds
    now = datetime.now(UTC)
    if interval is not None and now - run.last_checkpoint >= timedelta(seconds=interval):
        run.last_checkpoint = now
        await _automatic_checkpoint(turn, ctx, run)


async def _automatic_checkpoint(turn: TurnHandle, ctx: _Context, run: ExecutionRun) -> None:
    job = turn.job
    archive_id: str | None = None
    if ctx.tools is not None:
        try:
            archive_id = await checkpoint_workspace(
                ctx.redis, ctx.keys, tenant_id=job.tenant_id, task_id=job.task_id
            )
        except WorkspaceRequestError:
            # A checkpoint without its files would empty them on rollback: none.
            log.warning("execution %s: workspace not archived; no checkpoint", run.execution_id)
            return
    async with ctx.sessions.begin() as session:
        row = await session.get(Execution, run.execution_id)
        if row is None:
            return
        _snapshot, last_message = await executions.turn_position(session, job.task_id, job.turn_id)
        # At a boundary the turn's state is its latest snapshot (or, before the
        # first one, the state the loop starts from).
        await executions.add_checkpoint(
            session,
            row,
            label="automatic",
            state=row.state,
            turn_state=turn.state.to_json(),
            last_message_id=last_message,
            working_memory=dict(turn.state.working_memory),
            workspace_archive_id=archive_id,
            automatic=True,
        )


def interrupt_for_pause(runner: _RunsTurn) -> None:
    """A pause request published for this turn (``Keys.pauses``): a model call in
    its stream is cut off now rather than awaited — the turn then parks as at a
    boundary, and on resume that call runs again (``turn_resumed`` names its
    partial output to drop). A tool call is never cut: its step ends first and
    the boundary check parks the turn.

    ``streaming`` is set and cleared with no await between it and the stream, so
    the cancellation lands inside the model call. A request that arrives
    between two calls is kept (``pause_pending``): the boundary check before
    the next call may have read the pause key before the gateway set it, and
    that call would otherwise stream whole before the turn parks.
    """
    turn = runner.handle
    if turn.pausable:
        turn.interrupt_for_pause()


async def park_paused(turn: TurnHandle, ctx: _Context, *, cut: bool = False) -> str:
    """Park the turn on its pause request, the way a HITL question parks it.

    ``cut``: a model call was cut off; the snapshot keeps the last boundary's
    ``last_seq``, so the resumer names the call's partial output (as after a
    hand-back).

    ``handed_back`` instead when the pause was withdrawn meanwhile (a resume
    raced it): the turn goes on from the snapshot on whichever worker takes its
    job. ``Superseded`` when this worker's lease lapsed and another holds the turn.
    """
    job = turn.job
    await turn.snapshot("pause", advance=not cut)
    await turn.keep_task_while_parked()
    # One transaction: the lease goes (as Leases.release(status="paused") does)
    # with the row marked, so the execution reads paused exactly when no worker
    # holds the turn any more.
    async with ctx.sessions.begin() as session:
        # Read under the execution's row lock, which a resume takes to withdraw
        # the request: a pause withdrawn by now (a resume raced this stop, or a
        # late pause message cut a resumed call) is not carried out.
        await executions.lock_for_pause(session, job.task_id)
        if await ctx.redis.get(ctx.keys.pause(job.task_id)) != job.turn_id:
            withdrawn = True
        else:
            withdrawn = False
            # A pause may last as long as a question may wait: the snapshot must too.
            await ctx.snapshots.keep_latest_while_parked(session, job.turn_id)
            if not await ctx.leases.release_in(session, job.turn_id, status="paused"):
                # Our lease lapsed and another worker runs the turn: it parks it
                # (or goes on), and this worker's view of the execution is stale.
                raise Superseded()
            await executions.mark_paused(session, job.task_id, turn.state.active_ms)
    if withdrawn:
        # Went on from the snapshot just taken by whoever takes the job (the
        # resume queued one too; the second to come finds the turn taken or over).
        await ctx.leases.release(job.turn_id)
        await turn.requeue(TurnJob.resuming(job.tenant_id, job.task_id, job.turn_id))
        return "handed_back"
    if ctx.tools is not None:
        # A pause may last hours, and checkpoints are taken during one: what the
        # task's tools left running (a stdio MCP server, which a turn's end would
        # reap) must not wait with it, nor change the workspace meanwhile
        # (security issue #23). Sent whether this run used tools or not: a
        # session may be from before a park of the same turn.
        await ctx.tools.turn_ended(job.tenant_id, job.task_id)
    if await turn.cancel_requested():
        # A cancel that came while the turn was stopping for the pause found it
        # stopping already and was not taken: the turn goes back to the queue,
        # and the worker that takes it ends it as cancelled. (A cancel that
        # comes later finds it paused: the gateway does the same.)
        async with ctx.sessions.begin() as session:
            requeue = await executions.claimable_again(session, job.turn_id)
        if requeue:
            await turn.requeue(job.model_copy(update={"resume": True}))
    return "paused"


async def turn_ended(turn: TurnHandle, ctx: _Context, status: str, last: list[Any]) -> None:
    """After the turn's end is recorded: the execution's status, or a retry."""
    job = turn.job
    if turn.pausable:
        # A pause that came too late to be carried out.
        await ctx.redis.delete(ctx.keys.pause(job.task_id))
    run = turn.execution
    if run is None:
        return
    error = next((e for e in last if isinstance(e, ErrorEvent)), None)
    active_ms = turn.active_ms()
    if status == "errored" and error is not None and error.error not in _NOT_RETRIED:
        if await _retry(turn, ctx, run, f"{error.error}: {error.message}"):
            return
    async with ctx.sessions.begin() as session:
        if status == "completed":
            await executions.mark_ended(session, job.task_id, "completed", turn_active_ms=active_ms)
        elif status == "cancelled":
            await executions.mark_ended(
                session, job.task_id, "terminated", turn_active_ms=active_ms
            )
        else:
            reason = f"{error.error}: {error.message}" if error else "the turn failed"
            await executions.mark_ended(
                session, job.task_id, "failed", turn_active_ms=active_ms, reason=reason
            )


async def _retry(turn: TurnHandle, ctx: _Context, run: ExecutionRun, reason: str) -> bool:
    """Roll back to the last checkpoint and run the turn again after the backoff;
    False when no attempt is left (or the task moved on)."""
    job = turn.job
    async with ctx.sessions.begin() as session:
        attempt = await executions.count_attempt(
            session, run.execution_id, max_attempts=run.retry_max_attempts
        )
    if attempt is None:
        return False
    # The terminal event let the task go: take it again, unless a new message
    # already did (that turn is the task's now; this execution ends failed).
    if not await ctx.lock.acquire(job.task_id, job.turn_id):
        return False
    log.info("execution %s: attempt %d after %s", run.execution_id, attempt + 1, reason)
    try:
        await _roll_back_for_retry(turn, ctx, run)
    except Exception:
        log.exception("execution %s: the retry could not be prepared", run.execution_id)
        await ctx.lock.release(job.task_id, job.turn_id)
        return False
    await asyncio.sleep(run.retry_backoff_seconds)
    await ctx.leases.release(job.turn_id)
    await turn.requeue(TurnJob.resuming(job.tenant_id, job.task_id, job.turn_id))
    return True


async def _roll_back_for_retry(turn: TurnHandle, ctx: _Context, run: ExecutionRun) -> None:
    """The task back at the execution's last checkpoint, the turn running again
    and held by this worker through the backoff."""
    async with ctx.sessions() as session:
        row = await session.get(Execution, run.execution_id)
        checkpoint = await executions.latest_checkpoint(session, run.execution_id)
    assert row is not None
    await roll_back(
        sessions=ctx.sessions,
        redis=ctx.redis,
        keys=ctx.keys,
        eventlog=ctx.eventlog,
        execution=row,
        task_name=turn.task_name,
        target=RollbackTarget(checkpoint),
        snapshot_ttl=ctx.snapshots.active_ttl,
    )
    async with ctx.sessions.begin() as session:
        # Ours until the backoff ends: should this worker die meanwhile, the
        # lease lapses and whoever takes the job over runs the retry.
        await ctx.leases.hold_in(
            session,
            turn.job.turn_id,
            seconds=run.retry_backoff_seconds,
        )
