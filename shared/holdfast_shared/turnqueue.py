"""Messages that wait for a task's running turn (``on_busy`` on ``POST /execute``).

A message sent with ``enqueue``, ``interrupt`` or ``steer`` while its task
has a running turn is stored at once, durably, as a *pending* turn: a
``turns`` row in one of :data:`PENDING` statuses with its user message at
position 0, committed before the request is acknowledged. The row's id is
the turn id it runs as; nothing about it lives only in Redis.

* ``interrupting`` (``interrupt``): the running turn is being cancelled;
  these start first, in arrival order.
* ``steering`` (``steer``): the running turn takes it in at its next
  iteration boundary (the loop-worker's ``steering.py``, which deletes the
  row and stores the message in that turn). If the turn ends first, it
  starts as a turn of its own, in arrival order with the waiting ones.
* ``waiting`` (``enqueue``): runs after the running turn, in arrival order.

Arrival order is the order of the user messages' ids (a sequence), so two
requests that were each acknowledged before the next was sent keep their
order. A pending turn's messages are left out of the conversation
(:func:`holdfast_shared.conversation.load_history`) until it starts; it then
gets its message stored again, under a new id, so the conversation reads in
the order things happened.

:func:`start_next` promotes the head of the queue: whoever ends a turn calls
it (the loop-worker), as does the gateway right after storing a pending turn
(the running turn may have ended meanwhile) and the loop-worker's sweep
(:func:`promote_stranded`, for a worker that died between ending a turn and
starting the next). Mutual exclusion is twofold: PostgreSQL (no turn of the
task is queued, running or parked; the head's row is locked while it is
promoted) and the Redis turn lock, taken for the head inside that
transaction — so a promotion that dies half-way leaves either nothing or a
lock held by a pending turn, which the next promotion takes over.

The turn queue is both halves: these pending turns in PostgreSQL, and the
``turns`` stream a started turn goes on for a loop-worker, whose one writer is
:func:`queue_turn` (``start_next`` and every re-queue call it).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Literal

from redis.asyncio import Redis
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_shared.db.models import Message, Task, Turn
from holdfast_shared.errors import Superseded
from holdfast_shared.eventlog import EventLog, next_epoch
from holdfast_shared.events import ThreadLifecycle, UserMessage, body_json
from holdfast_shared.ids import created_ms
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import Keys
from holdfast_shared.turnlock import TurnLock

log = logging.getLogger(__name__)

BusyMode = Literal["reject", "enqueue", "interrupt", "steer"]

INTERRUPTING = "interrupting"
STEERING = "steering"
WAITING = "waiting"
# Statuses of a turn that has not started: its message waits for the task.
PENDING = (INTERRUPTING, STEERING, WAITING)
PENDING_BY_MODE: dict[str, str] = {
    "interrupt": INTERRUPTING,
    "steer": STEERING,
    "enqueue": WAITING,
}
# Statuses of a turn that holds the task (as the loop-worker's leases count them).
ACTIVE = ("queued", "running", "parked")
FINISHED = ("completed", "errored", "cancelled")

# A lock whose holder has no row is a gateway's that died mid-request once
# it is this old (as the gateway's own start_turn judges it).
_ABANDONED_AFTER_MS = 10_000


async def count_pending(session: AsyncSession, task_id: str) -> int:
    """How many of the task's messages wait for it."""
    found = await session.scalar(
        select(func.count())
        .select_from(Turn)
        .where(Turn.task_id == task_id, Turn.status.in_(PENDING))
    )
    return int(found or 0)


async def pending_ids(
    session: AsyncSession, task_id: str, statuses: tuple[str, ...] = PENDING
) -> list[str]:
    """The task's pending turns of ``statuses``, in the order they start:
    interrupting ones first, then by arrival."""
    query = (
        select(Turn.id)
        .join(Message, (Message.turn_id == Turn.id) & (Message.position == 0))
        .where(Turn.task_id == task_id, Turn.status.in_(statuses))
        .order_by(Turn.status != INTERRUPTING, Message.id)
    )
    return list((await session.scalars(query)).all())


async def start_next(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    keys: Keys,
    lock: TurnLock,
    eventlog: EventLog,
    task_id: str,
) -> str | None:
    """Start the task's next pending turn when nothing else holds the task.

    Returns the started turn's id, or None (nothing pending, or the task is
    busy: whoever holds it starts the next one when it ends). Safe to call
    from anywhere, any number of times at once: one call promotes, the
    others find the head taken or the task held.
    """
    async with sessions.begin() as session:
        active = await session.scalar(
            select(Turn.id).where(Turn.task_id == task_id, Turn.status.in_(ACTIVE)).limit(1)
        )
        if active is not None:
            return None
        heads = await pending_ids(session, task_id)
        if not heads:
            return None
        # Locks the head against a concurrent promoter (or a steer being taken
        # in); one that committed meanwhile leaves it no longer pending.
        head = await session.scalar(
            select(Turn)
            .where(Turn.id == heads[0], Turn.status.in_(PENDING))
            .with_for_update(skip_locked=True)
        )
        if head is None:
            return None
        if not await _take_lock(session, lock, task_id, head.id):
            return None
        # Fences the ``started`` below as the gateway's is: the stale-turn sweep
        # announces a promoted turn whose promoter died (or stalled) before it
        # did, moving the epoch on first (recovery._announce_promoted).
        epoch = await next_epoch(redis, keys, task_id)
        promoted_from = head.status
        try:
            task = await session.get_one(Task, task_id)
            # Stored again under a new id: the conversation reads in order.
            old = (
                await session.execute(
                    delete(Message)
                    .where(Message.turn_id == head.id)
                    .returning(Message.role, Message.content)
                )
            ).all()
            for role, content in old:
                session.add(
                    Message(
                        task_id=task_id, turn_id=head.id, position=0, role=role, content=content
                    )
                )
            now = datetime.now(UTC)
            # created_at now: the stale-turn sweep judges it as a turn just
            # accepted. lease_until now: a promotion that dies before its job is
            # queued is requeued by that sweep, never removed as unaccepted.
            await session.execute(
                update(Turn)
                .where(Turn.id == head.id)
                .values(status="queued", created_at=now, lease_until=now)
            )
            tenant_id, name = task.tenant_id, task.name
            agent, model = head.agent, head.model
            text = "".join(
                b.get("text", "")
                for _role, content in old
                for b in content.get("blocks", ())
                if b.get("type") == "text"
            )
        except BaseException:
            await lock.release(task_id, head.id)
            raise
    started = ThreadLifecycle(phase="started")
    bodies: list[tuple[str, str]] = [(started.type, body_json(started))]
    if promoted_from == STEERING:
        # Its turn ended before taking it in: say so where its client looks.
        note = UserMessage(text=text, message_id=head.id, steer=True, applied="next_turn")
        bodies.append((note.type, body_json(note)))
    try:
        await eventlog.append_bodies(task_id, head.id, bodies, name=name, epoch=epoch)
    except Superseded:
        # Stalled past the sweep, which announced and queued the turn itself.
        log.warning("pending turn %s of task %s was started by the sweep", head.id, task_id)
        return head.id
    job = TurnJob(task_id=task_id, turn_id=head.id, tenant_id=tenant_id, agent=agent, model=model)
    await queue_turn(redis, keys, job)
    log.info("started pending turn %s of task %s (%s)", head.id, task_id, promoted_from)
    return head.id


async def _take_lock(session: AsyncSession, lock: TurnLock, task_id: str, turn_id: str) -> bool:
    """The task's turn lock for ``turn_id``, taking it over from a holder that
    can no longer run: a pending turn whose promotion died, a finished turn,
    or a gateway's request that died before its turn row was written."""
    if await lock.ensure(task_id, turn_id):
        return True
    holder = await lock.holder(task_id)
    if holder is None:
        return await lock.ensure(task_id, turn_id)
    row = await session.scalar(
        select(Turn.status).where(Turn.id == holder).with_for_update(skip_locked=True)
    )
    if row is None:
        # No row, or one locked by a live promotion: only an old rowless lock is dead.
        exists = await session.scalar(select(Turn.id).where(Turn.id == holder))
        minted = created_ms(holder)
        if exists is not None or minted is None:
            return False
        if time.time() * 1000 - minted < _ABANDONED_AFTER_MS:
            return False
    elif row not in PENDING and row not in FINISHED:
        return False
    return await lock.replace(task_id, holder, turn_id)


async def promote_stranded(
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    keys: Keys,
    lock: TurnLock,
    eventlog: EventLog,
) -> int:
    """Start the next pending turn of every task that has some and no active
    turn: a worker died between ending a turn and starting the next, or a
    lock outlived its turn. Returns how many turns it started."""
    async with sessions() as session:
        tasks = (
            await session.scalars(select(Turn.task_id).where(Turn.status.in_(PENDING)).distinct())
        ).all()
    started = 0
    for task_id in tasks:
        try:
            if await start_next(sessions, redis, keys, lock, eventlog, task_id) is not None:
                started += 1
        except Exception:
            log.exception("could not start the next pending turn of task %s", task_id)
    if started:
        log.warning("started %d stranded pending turn(s)", started)
    return started


async def queue_turn(redis: Redis, keys: Keys, job: TurnJob) -> None:
    """Put ``job`` on the turns stream (``Keys.turns``) for a loop-worker.

    The one writer of that stream, for a new turn and a re-queued one alike
    (a hand-back, an answered question, a retry, a lost Redis): a job is only
    ever a pointer to a ``turns`` row, so queuing one twice is harmless (the
    turn's lease lets one worker through).
    """
    await redis.xadd(keys.turns, job.to_fields())
