"""Steering: user messages that join a running turn at an iteration boundary.

``POST /execute`` with ``on_busy: "steer"`` stores the message as a pending
turn in status ``steering`` (``holdfast_shared.turnqueue``). Before each model
call the turn looks for such messages of its task (:func:`pending_steers`):
it logs each as a ``user_message`` event, and then, in the transaction of
the step's snapshot, stores them as user messages of this turn and deletes
their pending rows (:func:`taken_in`) — so the model's next call sees them,
and a message is either still pending or part of the turn, never both or
neither. A worker that dies between the event and the snapshot leaves the
rows pending; the turn, resumed, takes them in again without logging them
twice (it saw their events when it resumed).

A steer the turn never reaches (it ended, was cancelled or failed first) is
started as the next turn by :func:`holdfast_shared.turnqueue.start_next`,
which whoever ends the turn calls (:func:`start_following`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from holdfast_shared.db.models import Message, Turn
from holdfast_shared.eventlog import EventLog
from holdfast_shared.keys import Keys
from holdfast_shared.turnlock import TurnLock
from holdfast_shared.turnqueue import STEERING, pending_ids, start_next
from redis.asyncio import Redis
from sqlalchemy import Delete, delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Steer:
    """A steering message: its pending turn's id (the ``message_id`` its
    sender was given) and its stored content."""

    message_id: str
    content: dict[str, Any]

    @property
    def text(self) -> str:
        blocks = self.content.get("blocks", ())
        return "".join(b.get("text", "") for b in blocks if b.get("type") == "text")


async def pending_steers(sessions: async_sessionmaker[AsyncSession], task_id: str) -> list[Steer]:
    """The task's steering messages, in arrival order (usually none: one
    indexed look-up per model call)."""
    async with sessions() as session:
        ids = await pending_ids(session, task_id, (STEERING,))
        if not ids:
            return []
        found = await session.execute(
            select(Message.turn_id, Message.content).where(
                Message.turn_id.in_(ids), Message.position == 0
            )
        )
        rows: dict[str, dict[str, Any]] = {turn_id: content for turn_id, content in found}
    return [Steer(i, rows[i]) for i in ids if i in rows]


def taken_in(steers: list[Steer]) -> Delete:
    """The statement that removes the steers' pending turns (and, by cascade,
    their pending copies of the message): run in the transaction that stores
    them in the running turn."""
    return delete(Turn).where(Turn.id.in_([s.message_id for s in steers]), Turn.status == STEERING)


async def start_following(
    sessions: async_sessionmaker[AsyncSession],
    reads: async_sessionmaker[AsyncSession],
    redis: Redis,
    keys: Keys,
    lock: TurnLock,
    eventlog: EventLog,
    task_id: str,
) -> None:
    """After a turn ended: start the task's next waiting message, if any.

    Failing here fails nothing: the message stays pending and the stale-turn
    sweep (:func:`holdfast_shared.turnqueue.promote_stranded`) starts it.
    """
    try:
        # Most turns end with nothing waiting: one autocommit look-up says so,
        # where start_next's transaction takes four round trips to.
        async with reads() as session:
            if not await pending_ids(session, task_id):
                return
        await start_next(sessions, redis, keys, lock, eventlog, task_id)
    except Exception:
        log.exception("could not start the next waiting message of task %s", task_id)
