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

from holdfast_shared.db.models import EventRecord, HitlRequestRecord, Task, Turn
from holdfast_shared.errors import Superseded
from holdfast_shared.eventlog import EventLog, next_epoch
from holdfast_shared.events import ThreadLifecycle, body_json
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import Keys
from holdfast_shared.observability import metrics
from holdfast_shared.turnlock import TurnLock
from holdfast_shared.turnqueue import queue_turn
from redis.asyncio import Redis
from sqlalchemy import ColumnElement, and_, delete, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

log = logging.getLogger(__name__)


async def queue_resume(
    redis: Redis, keys: Keys, tenant_id: str, task_id: str, turn_id: str
) -> None:
    await queue_turn(redis, keys, TurnJob.resuming(tenant_id, task_id, turn_id))


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


async def _tenants_of(session: AsyncSession, task_ids: list[str]) -> dict[str, str]:
    if not task_ids:
        return {}
    found = await session.execute(select(Task.id, Task.tenant_id).where(Task.id.in_(task_ids)))
    return {task_id: tenant_id for task_id, tenant_id in found.all()}


async def requeue_stale(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    keys: Keys,
    lock: TurnLock,
    eventlog: EventLog,
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
    abandoned = await _remove_unaccepted(sessions, redis, keys, eventlog, stale)
    await _announce_promoted(sessions, redis, keys, eventlog, stale)
    async with sessions.begin() as session:
        stale_turns = (
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
        rows = [(task_id, turn_id) for task_id, turn_id in stale_turns]
        rows += await _answered_but_parked(session, now, stale)
        tenants = await _tenants_of(session, [task_id for task_id, _ in rows])
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


async def _answered_but_parked(
    session: AsyncSession, now: datetime, stale: datetime
) -> list[tuple[str, str]]:
    """Parked turns whose every question was answered a while ago: the answer's
    resume job is gone (a Redis that lost its last writes, a gateway that died
    between the answer's commit and the job). Reserved as :func:`requeue_stale`
    reserves the others; a turn parked on a question still pending is left alone."""
    # By task first: hitl_requests is indexed on it.
    requests = select(HitlRequestRecord.request_id).where(
        HitlRequestRecord.task_id == Turn.task_id, HitlRequestRecord.turn_id == Turn.id
    )
    found = await session.execute(
        update(Turn)
        .where(
            Turn.status == "parked",
            or_(Turn.lease_until.is_(None), Turn.lease_until < stale),
            requests.where(
                HitlRequestRecord.status == "answered", HitlRequestRecord.answered_at < stale
            ).exists(),
            ~requests.where(HitlRequestRecord.status == "pending").exists(),
        )
        .values(lease_until=now)
        .returning(Turn.task_id, Turn.id)
        .execution_options(synchronize_session=False)
    )
    return [(task_id, turn_id) for task_id, turn_id in found.all()]


def _unannounced() -> ColumnElement[bool]:
    """A turn with no event in the archive."""
    return ~(
        select(EventRecord.seq)
        .where(EventRecord.task_id == Turn.task_id, EventRecord.turn_id == Turn.id)
        .exists()
    )


async def _archived_with_new_epochs(
    redis: Redis, keys: Keys, eventlog: EventLog, task_ids: set[str]
) -> dict[str, int]:
    """Each task's epoch moved on (a writer that began before is fenced off) and
    its log archived; the tasks whose log cannot be archived now are left out."""
    epochs: dict[str, int] = {}
    for task_id in task_ids:
        try:
            epoch = await next_epoch(redis, keys, task_id)
            await eventlog.archive_now(task_id)
        except Exception:  # one task's log must not hold up the sweep of every other turn
            log.warning(
                "task %s: its log cannot be archived now; judged later", task_id, exc_info=True
            )
            continue
        epochs[task_id] = epoch
    return epochs


async def _announce_promoted(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    keys: Keys,
    eventlog: EventLog,
    stale: datetime,
) -> None:
    """Log ``started`` for the pending turns promoted (``turnqueue.start_next``)
    longer than ``stale`` ago whose promoter died, or stalled, between its commit
    and its append: they are queued again below, and a turn must not run
    unannounced (its client, following the task, would see it end without
    starting). The promoter's own ``started`` is fenced by its epoch, so one
    that wakes later is refused. (A promoted steer's note is not repeated.)"""
    async with sessions() as session:
        candidates = (
            await session.execute(
                select(Turn.task_id, Turn.id).where(
                    Turn.status == "queued", Turn.lease_until < stale, _unannounced()
                )
            )
        ).all()
    if not candidates:
        return
    epochs = await _archived_with_new_epochs(redis, keys, eventlog, {t for t, _ in candidates})
    async with sessions() as session:
        still = (
            await session.execute(
                select(Turn.task_id, Turn.id).where(
                    Turn.id.in_([turn for task, turn in candidates if task in epochs]),
                    Turn.status == "queued",
                    _unannounced(),
                )
            )
        ).all()
    started = ThreadLifecycle(phase="started")
    for task_id, turn_id in still:
        try:
            await eventlog.append_bodies(
                task_id,
                turn_id,
                [(started.type, body_json(started))],
                name=await _name_of(sessions, task_id),
                epoch=epochs[task_id],
            )
        except Superseded:
            continue  # a worker took the turn up meanwhile: it is announced
        log.warning("announced pending turn %s of task %s for its dead promoter", turn_id, task_id)


async def _name_of(sessions: async_sessionmaker[AsyncSession], task_id: str) -> str:
    async with sessions() as session:
        return await session.scalar(select(Task.name).where(Task.id == task_id)) or task_id


async def _remove_unaccepted(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    keys: Keys,
    eventlog: EventLog,
    stale: datetime,
) -> list[tuple[str, str]]:
    """Delete the queued turns older than ``stale`` that no worker ever held
    and whose ``started`` event is nowhere; returns their (task, turn) ids.

    The archive alone does not say a turn was never accepted: its ``started``
    event may still be only in Redis (a full restart, a Redis that was down,
    or a slow archiver leaves the archive seconds behind), and its client is
    then waiting on it. So the candidates' tasks are archived first; one whose
    log cannot be archived now (Redis unreachable, say) is left for the next pass.

    Nor is a ``started`` absent now absent for good: the gateway may only be
    stalled between its commit and its append (SIGSTOP, a frozen VM). Each
    candidate's epoch is moved on before its archive, and the gateway's
    ``started`` is fenced by the epoch it began with: one that lands before
    is in the archive, one that comes after is refused (the client is told
    to retry).
    """

    def unaccepted() -> ColumnElement[bool]:
        return and_(
            Turn.status == "queued",
            Turn.lease_until.is_(None),
            Turn.created_at < stale,
            _unannounced(),
        )

    async with sessions() as session:
        query = select(Turn.task_id, Turn.id).where(unaccepted())
        candidates = (await session.execute(query)).all()
    if not candidates:
        return []
    archived = await _archived_with_new_epochs(redis, keys, eventlog, {t for t, _ in candidates})
    if not archived:
        return []
    async with sessions.begin() as session:
        removed = (
            await session.execute(
                delete(Turn)
                .where(
                    unaccepted(),
                    Turn.id.in_([turn for task, turn in candidates if task in archived]),
                )
                .returning(Turn.task_id, Turn.id)
            )
        ).all()
    return [(task_id, turn_id) for task_id, turn_id in removed]
