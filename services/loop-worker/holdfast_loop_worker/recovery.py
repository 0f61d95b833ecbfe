"""Putting unfinished turns back on the queue: after Redis lost its data, and
when a parked turn's question expires.

PostgreSQL is the record of which turns are unfinished (``turns.status``)
and who holds them (``turns.lease_until``); a resume job for a turn that is
in fact still running, or already over, is harmless: the worker that gets
it fails to claim the turn and drops it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

from holdfast_shared.db.models import Task, Turn
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import Keys
from redis.asyncio import Redis
from sqlalchemy import or_, select
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
    return len(rows)
