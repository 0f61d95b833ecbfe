"""Putting unfinished turns back on the queue: after Redis lost its data, and
when a parked turn's question expires.

PostgreSQL is the record of which turns are unfinished (``turns.status``)
and who holds them (``turns.lease_until``); a resume job for a turn that is
in fact still running, or already over, is harmless: the worker that gets
it fails to claim the turn and drops it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

from holdfast_shared.db.models import EventRecord, Task, Turn
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import Keys
from holdfast_shared.observability import metrics
from holdfast_shared.turnlock import TurnLock
from redis.asyncio import Redis
from sqlalchemy import delete, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

log = logging.getLogger(__name__)


async def queue_resume(
    redis: Redis, keys: Keys, tenant_id: str, task_id: str, turn_id: str
) -> None:
    job = TurnJob(task_id=task_id, turn_id=turn_id, tenant_id=tenant_id, resume=True)
    await redis.xadd(keys.turns, job.to_fields())


async def requeue_unfinished(
    sessions: async_sessionmaker[AsyncSession], redis: Redis, keys: Keys
) -> int:
    """Queue every queued or running turn that nobody holds a lease on."""
    async with sessions() as session:
        rows = (
            await session.execute(
                select(Task.tenant_id, Turn.task_id, Turn.id)
                .join(Task, Task.id == Turn.task_id)
                .where(
                    Turn.status.in_(("queued", "running")),
                    or_(Turn.lease_until.is_(None), Turn.lease_until < datetime.now(UTC)),
                )
            )
        ).all()
    for tenant_id, task_id, turn_id in rows:
        await queue_resume(redis, keys, tenant_id, task_id, turn_id)
    if rows:
        log.warning("queued %d unfinished turn(s) again from PostgreSQL", len(rows))
        metrics.TURNS_REQUEUED.labels("redis_lost").inc(len(rows))
    return len(rows)


async def requeue_stale(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    keys: Keys,
    lock: TurnLock,
    lease_seconds: int,
) -> int:
    """Queue unfinished turns that nobody has held for a while.

    XAUTOCLAIM normally hands a dead worker's turn to another worker; this
    catches the turns whose job itself is gone (a Redis that lost its last
    second of writes, or all of them). The lease is set to now as a
    reservation, so the sweep does not queue the same turn every pass; a
    duplicate job is harmless (the second claim fails, or finds it over).

    A queued turn whose ``started`` event was never logged was never
    accepted: its gateway failed (or died) mid-request and the client was
    told so. It is removed, not run, so the client's retry is the only run.
    """
    now = datetime.now(UTC)
    stale = now - timedelta(seconds=2 * lease_seconds)
    announced = (
        select(EventRecord.seq)
        .where(EventRecord.task_id == Turn.task_id, EventRecord.turn_id == Turn.id)
        .exists()
    )
    async with sessions.begin() as session:
        abandoned = (
            await session.execute(
                delete(Turn)
                .where(
                    Turn.status == "queued",
                    Turn.lease_until.is_(None),
                    Turn.created_at < stale,
                    ~announced,
                )
                .returning(Turn.task_id, Turn.id)
            )
        ).all()
        rows = (
            await session.execute(
                update(Turn)
                .where(
                    Turn.status.in_(("queued", "running")),
                    or_(
                        Turn.lease_until < stale,
                        Turn.lease_until.is_(None) & (Turn.created_at < stale),
                    ),
                )
                .values(lease_until=now)
                .returning(Turn.task_id, Turn.id)
            )
        ).all()
        tenants = (
            dict(
                (
                    await session.execute(
                        select(Task.id, Task.tenant_id).where(Task.id.in_([r[0] for r in rows]))
                    )
                ).all()
            )
            if rows
            else {}
        )
    for task_id, turn_id in abandoned:
        await lock.release(task_id, turn_id)
    if abandoned:
        log.warning("removed %d turn(s) that were never accepted", len(abandoned))
    for task_id, turn_id in rows:
        await queue_resume(redis, keys, tenants[task_id], task_id, turn_id)
    if rows:
        log.warning("queued %d stale turn(s) again", len(rows))
        metrics.TURNS_REQUEUED.labels("stale").inc(len(rows))
    return len(rows)
