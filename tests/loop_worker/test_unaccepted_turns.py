"""A turn committed by a gateway that then stalls before announcing it (its
``started`` event) is judged by the stale-turn sweep (``recovery.requeue_stale``).

The soak test met it: a gateway SIGSTOPped between its commit and its append
for longer than the sweep's 2 x lease; the sweep removed the turn as never
accepted, the gateway woke and announced it anyway, and its client waited on a
turn no worker would run. The sweep now moves the task's epoch on before it
looks, and the gateway's ``started`` is fenced by the epoch it began with.

Real Redis and PostgreSQL; a database of this module alone, since the sweep
judges every turn in it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from holdfast_loop_worker.recovery import requeue_stale
from holdfast_shared.db.models import EventRecord, Task, Turn
from holdfast_shared.errors import Superseded
from holdfast_shared.eventlog import EventLog, next_epoch
from holdfast_shared.events import ThreadLifecycle, body_json
from holdfast_shared.jobs import TurnJob
from holdfast_shared.turnlock import TurnLock
from redis.asyncio import Redis
from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.taskids import TENANTS

LEASE_SECONDS = 2
STARTED = ThreadLifecycle(phase="started")


@pytest.fixture
async def lock(redis: Redis, eventlog: EventLog) -> TurnLock:
    return TurnLock(redis, eventlog.keys, ttl_seconds=600)


@pytest.fixture
async def committed(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    eventlog: EventLog,
    lock: TurnLock,
    api_keys: dict[str, str],
) -> AsyncIterator[tuple[str, str, int]]:
    """What a gateway's start_turn has done when it stalls: the task's lock taken,
    its epoch begun, the turn and task committed (a while ago: the stall)."""
    task_id, turn_id = f"task_{secrets.token_hex(6)}", f"turn_{secrets.token_hex(6)}"
    assert await lock.acquire(task_id, turn_id)
    epoch = await next_epoch(redis, eventlog.keys, task_id)
    async with sessions.begin() as session:
        session.add(Task(id=task_id, tenant_id=TENANTS["main"], name=task_id))
        await session.flush()
        a_while_ago = datetime.now(UTC) - timedelta(seconds=10 * LEASE_SECONDS)
        session.add(Turn(id=turn_id, task_id=task_id, status="queued", created_at=a_while_ago))
    try:
        yield task_id, turn_id, epoch
    finally:
        async with sessions.begin() as session:
            await session.execute(delete(Task).where(Task.id == task_id))


async def announce(eventlog: EventLog, task_id: str, turn_id: str, epoch: int) -> None:
    """The gateway's append of ``started``, as start_turn makes it."""
    await eventlog.append_bodies(
        task_id,
        turn_id,
        [(STARTED.type, body_json(STARTED))],
        name=task_id,
        new_task=True,
        epoch=epoch,
    )


async def sweep(
    sessions: async_sessionmaker[AsyncSession], redis: Redis, eventlog: EventLog, lock: TurnLock
) -> int:
    return await requeue_stale(sessions, redis, eventlog.keys, lock, eventlog, LEASE_SECONDS)


async def test_a_gateway_that_wakes_after_the_sweep_cannot_announce_the_removed_turn(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    eventlog: EventLog,
    lock: TurnLock,
    committed: tuple[str, str, int],
) -> None:
    task_id, turn_id, epoch = committed
    await sweep(sessions, redis, eventlog, lock)
    async with sessions() as session:
        assert await session.get(Turn, turn_id) is None, "removed as never accepted"
    assert await lock.holder(task_id) is None, "the task is free for the client's retry"

    with pytest.raises(Superseded):
        await announce(eventlog, task_id, turn_id, epoch)
    assert await redis.xlen(eventlog.keys.events(task_id)) == 0, "nothing announced"


async def test_a_turn_announced_before_the_sweep_is_run_not_removed(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    eventlog: EventLog,
    lock: TurnLock,
    committed: tuple[str, str, int],
) -> None:
    task_id, turn_id, epoch = committed
    await announce(eventlog, task_id, turn_id, epoch)
    await sweep(sessions, redis, eventlog, lock)
    async with sessions() as session:
        row = await session.get(Turn, turn_id)
        assert row is not None and row.status == "queued"
        assert row.lease_until is not None, "reserved by the sweep, its job queued again"
        archived = await session.scalar(
            select(func.count()).select_from(EventRecord).where(EventRecord.turn_id == turn_id)
        )
    assert archived == 1, "its started was archived before the judgement"
    assert await lock.holder(task_id) == turn_id
    jobs = [TurnJob.find(fields) for _id, fields in await redis.xrange(eventlog.keys.turns)]
    assert any(job is not None and job.turn_id == turn_id and job.resume for job in jobs)


async def test_a_pending_turn_whose_promoter_died_is_announced_before_it_runs(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    eventlog: EventLog,
    lock: TurnLock,
    committed: tuple[str, str, int],
) -> None:
    """``turnqueue.start_next`` commits the promotion (status queued, a lease of now),
    then logs ``started``: a promoter that dies in between left a turn the sweep ran
    unannounced (the chaos run: a turn whose only lifecycle event was its end). The
    sweep now announces it, once, and the promoter's own append, if it wakes, is
    refused."""
    task_id, turn_id, promoters_epoch = committed
    async with sessions.begin() as session:
        row = await session.get_one(Turn, turn_id)
        row.lease_until = datetime.now(UTC) - timedelta(seconds=10 * LEASE_SECONDS)
    assert await sweep(sessions, redis, eventlog, lock) == 1
    await sweep(sessions, redis, eventlog, lock)  # a second pass announces nothing more

    entries = await redis.xrange(eventlog.keys.events(task_id))
    async with sessions() as session:
        archived = (
            await session.scalars(select(EventRecord.type).where(EventRecord.turn_id == turn_id))
        ).all()
    logged = [json.loads(fields["d"]) for _id, fields in entries]
    hot = [e["phase"] for e in logged if e["turn_id"] == turn_id and e["type"] == STARTED.type]
    assert archived.count(STARTED.type) + hot.count("started") == 1, (archived, logged)
    jobs = [TurnJob.find(fields) for _id, fields in await redis.xrange(eventlog.keys.turns)]
    assert any(job is not None and job.turn_id == turn_id for job in jobs), "queued to run"
    with pytest.raises(Superseded):
        await announce(eventlog, task_id, turn_id, promoters_epoch)
