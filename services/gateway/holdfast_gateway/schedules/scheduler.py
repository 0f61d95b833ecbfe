"""The scheduler every gateway runs: it sleeps until the next due time and fires it.

Each round locks the schedules that are due (or have a waiting run) with
``FOR NO KEY UPDATE SKIP LOCKED``: a schedule another gateway is handling is
left to it, so however many gateways run, each due time is handled by one
(``firing.py`` says how the run row makes it exactly once). Between rounds
it sleeps until the earliest next due time, at most
``HOLDFAST_SCHEDULE_POLL_SECONDS``, or until ``state.schedules_changed`` is
set (a schedule created or resumed on this gateway).

Owner: the gateway's lifespan runs :meth:`Scheduler.run` in its
``Background`` and cancels it at shutdown; a round cut short by the cancel
rolls back its schedule updates, and the next round (on any gateway) does
that work again without firing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import NoReturn

from holdfast_shared.db.models import Schedule, ScheduleRun
from sqlalchemy import func, or_, select

from holdfast_gateway.schedules.firing import Firing
from holdfast_gateway.state import GatewayState

log = logging.getLogger(__name__)

# Schedules one round locks and handles; a full batch means another round at once.
_BATCH = 20


class Scheduler:
    """Reads the time from ``state.clock``; ``state.schedules_changed`` wakes it."""

    def __init__(self, state: GatewayState) -> None:
        self._state = state
        self._clock = state.clock
        self._poll = state.settings.schedule_poll_seconds
        self._firing = Firing(state, state.clock, state.settings.schedule_catch_up_max)
        self._woken = state.schedules_changed

    async def run(self) -> NoReturn:
        while True:
            self._woken.clear()
            try:
                delay = await self.round()
            except Exception:
                log.warning("the scheduler's round failed; trying again", exc_info=True)
                delay = self._poll
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), delay)

    async def round(self) -> float:
        """Handle what is due now; the seconds until the next round should start."""
        now = self._clock.now()
        waiting = select(ScheduleRun.schedule_id).where(ScheduleRun.status == "waiting")
        async with self._state.sessions.begin() as session:
            rows = list(
                await session.scalars(
                    select(Schedule)
                    .where(
                        or_(
                            (Schedule.status == "active") & (Schedule.next_due_at <= now),
                            (Schedule.status != "paused") & Schedule.id.in_(waiting),
                        )
                    )
                    .order_by(Schedule.next_due_at)
                    .limit(_BATCH)
                    .with_for_update(key_share=True, skip_locked=True)
                )
            )
            for row in rows:
                schedule_id = row.id
                try:
                    # A savepoint each: one schedule's failure (its agent's
                    # store down...) does not undo the others' round.
                    async with session.begin_nested():
                        await self._firing.handle(session, row, now)
                except Exception:
                    log.warning("schedule %s: its round failed", schedule_id, exc_info=True)
        if len(rows) == _BATCH:
            return 0.0
        async with self._state.sessions() as session:
            upcoming = await session.scalar(
                select(func.min(Schedule.next_due_at)).where(Schedule.status == "active")
            )
        if upcoming is None:
            return self._poll
        return min(max((upcoming - self._clock.now()).total_seconds(), 0.0), self._poll)
