"""One schedule's turn to fire: its waiting run, then its due times.

The caller (``scheduler.py``) holds the schedule's row locked (``FOR NO KEY
UPDATE``, so the run rows' foreign keys can still be checked by the turn's own
transaction) and commits ``session`` once :func:`handle` returns: the runs it
skipped or made wait and the schedule's next due time commit together. A
run that starts a turn is written by the turn's transaction instead
(``start_turn``'s ``also``), so a gateway dying at any point leaves either
the turn and its run row or neither; the next gateway to lock the schedule
finds the row and does not fire that due time again.

Overlap (the previous run's turn still active, or runs already waiting):
``skip`` records the due time as skipped; ``enqueue`` makes it wait (at most
:data:`MAX_WAITING` per schedule) and it starts once that turn has ended;
``cancel_previous`` cancels that turn as ``POST /execute/cancel`` does, then
starts at once on a new task, or waits for the cancelled turn to end on the
schedule's own task.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from holdfast_shared.db.models import Schedule, ScheduleRun, Turn
from holdfast_shared.errors import ErrorCode
from holdfast_shared.turnqueue import FINISHED
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway.cancelling import request_cancel
from holdfast_gateway.clock import Clock
from holdfast_gateway.errors import ApiError
from holdfast_gateway.schedules.when import When
from holdfast_gateway.state import GatewayState
from holdfast_gateway.tasks import TaskRef, find_task
from holdfast_gateway.turns import start_turn

log = logging.getLogger(__name__)

# Runs one schedule may have waiting (overlap enqueue); a due time past it is skipped.
MAX_WAITING = 10
_BUSY = frozenset({ErrorCode.TURN_IN_PROGRESS, ErrorCode.HITL_REQUIRED})


def when_of(row: Schedule) -> When:
    return When(
        timezone=row.timezone,
        anchor_at=row.anchor_at,
        cron=row.cron,
        interval_seconds=row.interval_seconds,
        at=row.at,
    )


@dataclass(frozen=True, slots=True)
class _Running:
    """The previous run's turn, still active."""

    task_id: str  # the engine's id, for the cancel
    turn_id: str


class _AlreadyStarted(Exception):
    """The waiting run was started (or dropped) meanwhile: its turn is rolled back."""


class Firing:
    """Fires schedules' due times for one gateway; see the module docstring."""

    def __init__(self, state: GatewayState, clock: Clock, catch_up_max: int) -> None:
        self._state = state
        self._clock = clock
        self._catch_up_max = catch_up_max

    async def handle(self, session: AsyncSession, row: Schedule, now: datetime) -> None:
        """Start the schedule's oldest waiting run if it may, fire its due
        times up to ``now`` (by its catch-up policy) and advance it."""
        await self._start_waiting(session, row)
        if row.status != "active" or row.next_due_at is None or row.next_due_at > now:
            return
        when = when_of(row)
        limit = 1 if row.catch_up == "latest" else self._catch_up_max
        for due in when.due_until(row.next_due_at, now, limit):
            await self._fire(session, row, due)
        row.next_due_at = when.next_after(now)
        if row.next_due_at is None:
            row.status = "completed"

    async def _fire(self, session: AsyncSession, row: Schedule, due: datetime) -> None:
        fired = select(ScheduleRun.id).where(
            ScheduleRun.schedule_id == row.id, ScheduleRun.due_at == due
        )
        if await session.scalar(fired) is not None:
            return  # fired before its gateway died, the schedule not yet advanced
        running = await _running(session, row.id)
        waiting = await _count_waiting(session, row.id)
        if running is None and waiting == 0:
            try:
                await self._start(row, due)
                return
            except ApiError as exc:
                if exc.code not in _BUSY:
                    _record(session, row, due, "failed", exc.message)
                    return
                # The schedule's task is busy with another client's turn.
                running = await self._holder(row)
        if row.overlap == "skip":
            if running is not None:
                busy = f"turn {running.turn_id} is still active"
            else:
                busy = f"{waiting} runs wait" if waiting else "the task is busy"
            _record(session, row, due, "skipped", f"overlap skip: {busy}")
            return
        if row.overlap == "cancel_previous" and running is not None:
            await request_cancel(self._state, row.tenant_id, running.task_id, running.turn_id)
            if row.task_id is None and waiting == 0:
                # A new task per run: nothing to wait for.
                try:
                    await self._start(row, due)
                except ApiError as exc:
                    _record(session, row, due, "failed", exc.message)
                return
        if waiting >= MAX_WAITING:
            reason = f"overlap {row.overlap}: {waiting} runs already wait (at most {MAX_WAITING})"
            _record(session, row, due, "skipped", reason)
        else:
            _record(session, row, due, "waiting", None)

    async def _start_waiting(self, session: AsyncSession, row: Schedule) -> None:
        if row.status == "paused":
            return
        run = await session.scalar(
            select(ScheduleRun)
            .where(ScheduleRun.schedule_id == row.id, ScheduleRun.status == "waiting")
            .order_by(ScheduleRun.due_at)
            .limit(1)
        )
        if run is None or await _running(session, row.id) is not None:
            return
        try:
            await self._start(row, run.due_at, run.id)
        except ApiError as exc:
            if exc.code in _BUSY:
                if row.overlap == "cancel_previous" and (holder := await self._holder(row)):
                    await request_cancel(self._state, row.tenant_id, holder.task_id, holder.turn_id)
                return  # another client's turn on the schedule's task: wait for it
            run.status, run.reason = "failed", exc.message

    async def _start(self, row: Schedule, due: datetime, waiting_run: int | None = None) -> None:
        """Start the run's turn, its run row written in the turn's transaction;
        nothing when another gateway did (or, for ``waiting_run``, meanwhile)."""

        async def write_run(session: AsyncSession, task: TaskRef, turn_id: str) -> None:
            values: dict[str, Any] = {
                "status": "started",
                "task_id": task.name,
                "turn_id": turn_id,
                "fired_at": self._clock.now(),
            }
            if waiting_run is None:
                session.add(ScheduleRun(schedule_id=row.id, due_at=due, **values))
                await session.flush()
                return
            changed = await session.execute(
                update(ScheduleRun)
                .where(ScheduleRun.id == waiting_run, ScheduleRun.status == "waiting")
                .values(**values)
            )
            if getattr(changed, "rowcount", 0) != 1:
                raise _AlreadyStarted

        try:
            await start_turn(
                self._state,
                row.tenant_id,
                message=row.message,
                task_id=row.task_id,
                agent=row.agent,
                model=None,
                media=[],
                user_id=row.user_id,
                webhook=row.webhook,
                output_schema=row.output_schema,
                also=write_run,
            )
        except (IntegrityError, _AlreadyStarted):
            log.info("schedule %s: due time %s already fired", row.id, due.isoformat())

    async def _holder(self, row: Schedule) -> _Running | None:
        """The turn running on the schedule's own task, if any."""
        if row.task_id is None:
            return None
        async with self._state.sessions() as session:
            task = await find_task(session, row.tenant_id, row.task_id)
        if task is None:
            return None
        turn_id = await self._state.lock.holder(task.id)
        return None if turn_id is None else _Running(task.id, turn_id)


async def _running(session: AsyncSession, schedule_id: str) -> _Running | None:
    """The schedule's latest started run's turn, while it has not ended."""
    found = (
        await session.execute(
            select(Turn.task_id, Turn.id, Turn.status)
            .join(ScheduleRun, ScheduleRun.turn_id == Turn.id)
            .where(ScheduleRun.schedule_id == schedule_id, ScheduleRun.status == "started")
            .order_by(ScheduleRun.due_at.desc())
            .limit(1)
        )
    ).first()
    if found is None or found.status in FINISHED:
        return None
    return _Running(found.task_id, found.id)


async def _count_waiting(session: AsyncSession, schedule_id: str) -> int:
    return int(
        await session.scalar(
            select(func.count())
            .select_from(ScheduleRun)
            .where(ScheduleRun.schedule_id == schedule_id, ScheduleRun.status == "waiting")
        )
        or 0
    )


def _record(
    session: AsyncSession, row: Schedule, due: datetime, status: str, reason: str | None
) -> None:
    session.add(ScheduleRun(schedule_id=row.id, due_at=due, status=status, reason=reason))
