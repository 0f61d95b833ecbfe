"""What a task is doing, read from PostgreSQL (and the event log's Redis copy).

Everything here is derived from rows the engine commits anyway, so it is as
right after a crash as before it:

* **status** — from the task's turns and questions: ``paused`` (a turn
  paused by the execution API: ``turns.status = 'paused'``), ``waiting`` (a
  turn parked on a pending question, ``hitl_requests``), ``running`` (a turn
  queued, running, or parked with its answer in, or messages waiting for the
  task: ``on_busy``), else ``idle``.
* **usage** — summed over the task's turns: a finished turn's totals are on
  its row, written in the transaction that records its end; a turn still
  under way has them in its latest snapshot (what a worker taking it over
  continues from); a turn that ended before the row kept them, in its
  trajectory; a turn whose end is logged and not yet on its row, in its
  last logged ``usage`` (:func:`ended_turn`).
  A turn logs its end and frees the task (the Redis turn lock) in one step,
  and records its end on its row just after: a ``running`` task whose lock
  is free has ended its turn, and reads ``idle`` (:func:`settle`) — what
  ``POST /execute`` would find, as it would take the next message.
* **the last event** — the higher of the Redis copy's last entry and the
  archived log's.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from holdfast_shared.branches import ON_CURRENT_BRANCH
from holdfast_shared.db.models import (
    ChannelStateSnapshot,
    ConversationFork,
    EventRecord,
    HitlRequestRecord,
    Message,
    Task,
    TrajectoryRecord,
    Turn,
)
from holdfast_shared.eventlog import EventLog
from holdfast_shared.events import (
    TERMINAL_PHASES,
    USAGE_COUNTS,
    Event,
    ThreadLifecycle,
    Usage,
    parse_event,
)
from holdfast_shared.ids import is_valid_id
from holdfast_shared.turnlock import TurnLock
from holdfast_shared.turnqueue import PENDING
from sqlalchemy import ColumnElement, and_, case, exists, func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

TaskStatus = Literal["idle", "running", "waiting", "paused"]


class BadCursor(ValueError):
    """A ``cursor`` this module did not hand out."""


def status_of() -> ColumnElement[str]:
    """A ``tasks`` row's status, as a SQL expression."""
    task_id = Task.id

    def turn_in(*statuses: str) -> ColumnElement[bool]:
        return exists().where(Turn.task_id == task_id, Turn.status.in_(statuses))

    question = exists().where(
        HitlRequestRecord.task_id == task_id, HitlRequestRecord.status == "pending"
    )
    return case(
        (turn_in("paused"), "paused"),
        (and_(turn_in("parked"), question), "waiting"),
        (turn_in("queued", "running", "parked", *PENDING), "running"),
        else_="idle",
    )


async def settle(lock: TurnLock, task_id: str, status: str) -> str:
    """``status`` (from the rows) as ``POST /execute`` would see it: a turn
    that logged its end frees the lock before its row says so."""
    if status == "running" and await lock.holder(task_id) is None:
        return "idle"
    return status


# -- the list ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskRow:
    id: str
    name: str
    status: str
    agent: str | None
    model: str | None
    turn_count: int
    created_at: datetime
    updated_at: datetime


def encode_cursor(updated_at: datetime, task_id: str) -> str:
    raw = json.dumps([updated_at.isoformat(), task_id], separators=(",", ":"))
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        when, task_id = json.loads(raw)
        # The id goes into SQL: only what the engine mints (no NUL, no odd bytes).
        if not isinstance(when, str) or not isinstance(task_id, str) or not is_valid_id(task_id):
            raise BadCursor(cursor)
        moment = datetime.fromisoformat(when)
    except (binascii.Error, ValueError, TypeError) as exc:
        raise BadCursor(cursor) from exc
    if moment.tzinfo is None:
        raise BadCursor(cursor)
    return moment, task_id


def _turn_count() -> ColumnElement[int]:
    return (
        select(func.count())
        .select_from(Turn)
        .where(Turn.task_id == Task.id, Turn.status.not_in(PENDING))
        .scalar_subquery()
    )


async def list_tasks(
    session: AsyncSession,
    tenant_id: str,
    *,
    limit: int,
    cursor: str | None,
    status: TaskStatus | None,
) -> tuple[list[TaskRow], str | None]:
    """A page of the tenant's tasks, newest activity (a turn started or ended)
    first, and the cursor of the next page (None on the last)."""
    status_expr = status_of()
    query = (
        select(
            Task.id,
            Task.name,
            status_expr,
            Task.agent,
            Task.model,
            _turn_count(),
            Task.created_at,
            Task.updated_at,
        )
        .where(Task.tenant_id == tenant_id)
        .order_by(Task.updated_at.desc(), Task.id.desc())
        .limit(limit + 1)
    )
    if cursor is not None:
        after_time, after_id = decode_cursor(cursor)
        query = query.where(tuple_(Task.updated_at, Task.id) < tuple_(after_time, after_id))
    if status == "idle":
        # A turn that just logged its end is idle before its row says so (the
        # caller settles each row; see settle).
        query = query.where(status_expr.in_(("idle", "running")))
    elif status is not None:
        query = query.where(status_expr == status)
    rows = (await session.execute(query)).all()
    page = [
        TaskRow(
            id=r[0],
            name=r[1],
            status=r[2],
            agent=r[3],
            model=r[4],
            turn_count=int(r[5]),
            created_at=r[6],
            updated_at=r[7],
        )
        for r in rows[:limit]
    ]
    more = len(rows) > limit
    last = rows[limit - 1] if more else None
    return page, (encode_cursor(last[7], last[0]) if last is not None else None)


# -- one task ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskDetail:
    name: str
    status: str
    agent: str | None
    model: str | None
    created_at: datetime
    updated_at: datetime
    turn_count: int
    current_turn: dict[str, Any] | None
    usage: dict[str, Any]
    pending_hitl: dict[str, Any] | None


def _ms_iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


async def task_detail(
    session: AsyncSession, task_id: str, ended: EndedTurn | None = None
) -> TaskDetail | None:
    """The task's status, turns, usage totals and pending question (not the
    last event: :func:`last_event` reads the log; ``ended``, from
    :func:`ended_turn`, is a turn whose end is logged and not yet on its row)."""
    row = (
        await session.execute(
            select(
                Task.name,
                status_of(),
                Task.agent,
                Task.model,
                Task.created_at,
                Task.updated_at,
                _turn_count(),
            ).where(Task.id == task_id)
        )
    ).first()
    if row is None:
        return None
    turn = (
        await session.execute(
            select(Turn.id, Turn.status, Turn.stop_reason, Turn.created_at, Turn.finished_at)
            .where(Turn.task_id == task_id, Turn.status.not_in(PENDING))
            .order_by(Turn.created_at.desc(), Turn.id.desc())
            .limit(1)
        )
    ).first()
    question = (
        await session.execute(
            select(HitlRequestRecord)
            .where(HitlRequestRecord.task_id == task_id, HitlRequestRecord.status == "pending")
            .order_by(HitlRequestRecord.created_at)
            .limit(1)
        )
    ).scalar_one_or_none()
    return TaskDetail(
        name=row[0],
        status=row[1],
        agent=row[2],
        model=row[3],
        created_at=row[4],
        updated_at=row[5],
        turn_count=int(row[6]),
        current_turn=(
            None
            if turn is None
            else {
                "turn_id": turn[0],
                "status": turn[1],
                "stop_reason": turn[2],
                "created_at": _ms_iso(turn[3]),
                "finished_at": _ms_iso(turn[4]),
            }
        ),
        usage=await usage_totals(session, task_id, ended),
        pending_hitl=(
            None
            if question is None
            else {
                "request_id": question.request_id,
                "turn_id": question.turn_id,
                "kind": question.kind,
                "question": question.question,
                "tool_call": question.tool_call,
                "created_at": _ms_iso(question.created_at),
                "expires_at": _ms_iso(question.expires_at),
            }
        ),
    )


async def usage_totals(
    session: AsyncSession, task_id: str, ended: EndedTurn | None = None
) -> dict[str, Any]:
    """The task's token counts and active seconds, summed over its turns."""
    turns = (
        await session.execute(
            select(Turn.id, Turn.usage, Turn.active_ms).where(
                Turn.task_id == task_id, Turn.status.not_in(PENDING)
            )
        )
    ).all()
    per_turn: dict[str, tuple[dict[str, Any], int]] = {
        t[0]: (t[1], t[2] or 0) for t in turns if t[1] is not None
    }
    missing = [t[0] for t in turns if t[1] is None]
    if ended is not None and ended.turn_id in missing:
        # Its end is logged, its row not written yet: its last snapshot would
        # miss the call the end cut off, the logged usage has it.
        per_turn[ended.turn_id] = (ended.usage, ended.active_ms)
        missing.remove(ended.turn_id)
    if missing:
        # Under way: the newest snapshot (expired ones too: nothing newer exists).
        snapshots = await session.execute(
            select(ChannelStateSnapshot.turn_id, ChannelStateSnapshot.state)
            .where(ChannelStateSnapshot.turn_id.in_(missing))
            .order_by(ChannelStateSnapshot.turn_id, ChannelStateSnapshot.id.desc())
            .distinct(ChannelStateSnapshot.turn_id)
        )
        for turn_id, state in snapshots.all():
            per_turn[turn_id] = (state.get("usage") or {}, int(state.get("active_ms") or 0))
        missing = [t for t in missing if t not in per_turn]
    if missing:
        records = await session.execute(
            select(TrajectoryRecord.id, TrajectoryRecord.record).where(
                TrajectoryRecord.id.in_(missing)
            )
        )
        for turn_id, record in records.all():
            timings = record.get("timings") or {}
            per_turn[turn_id] = (record.get("usage") or {}, int(timings.get("active_ms") or 0))
    totals: dict[str, Any] = dict.fromkeys(USAGE_COUNTS, 0)
    active_ms = 0
    for usage, ms in per_turn.values():
        for name in USAGE_COUNTS:
            value = usage.get(name, 0)
            totals[name] += value if isinstance(value, int) else 0
        active_ms += ms
    totals["active_seconds"] = active_ms / 1000
    return totals


@dataclass(frozen=True, slots=True)
class LastEvent:
    seq: int
    timestamp: int
    event: Event


async def last_event(eventlog: EventLog, session: AsyncSession, task_id: str) -> LastEvent | None:
    """The task's last logged event, None before any."""
    best: tuple[int, str] | None = None
    hot = await eventlog.redis.xrevrange(eventlog.keys.events(task_id), count=1)
    if hot:
        entry_id, fields = hot[0]
        best = (int(str(entry_id).split("-", 1)[0]), fields["d"])
    cold = (
        await session.execute(
            select(EventRecord.seq, EventRecord.data)
            .where(EventRecord.task_id == task_id)
            .order_by(EventRecord.seq.desc())
            .limit(1)
        )
    ).first()
    if cold is not None and (best is None or cold[0] > best[0]):
        best = (int(cold[0]), cold[1])
    if best is None:
        return None
    event = parse_event(best[1])
    return LastEvent(best[0], event.timestamp, event)


async def last_result(session: AsyncSession, task_id: str) -> dict[str, Any] | None:
    """The structured result (``output_schema``) of the task's latest turn that
    ended with one: ``{turn_id, result, finished_at}``; None when none did."""
    found = (
        await session.execute(
            select(Turn.id, Turn.result, Turn.finished_at)
            .where(Turn.task_id == task_id, Turn.status == "completed", Turn.result.is_not(None))
            .order_by(Turn.finished_at.desc())
            .limit(1)
        )
    ).first()
    if found is None:
        return None
    turn_id, result, finished_at = found
    return {"turn_id": turn_id, "result": result, "finished_at": finished_at}


@dataclass(frozen=True, slots=True)
class EndedTurn:
    """A turn whose end the log holds, with the usage it logged last."""

    turn_id: str
    usage: dict[str, Any]
    active_ms: int


# A turn's last ``usage`` comes just before its end; the few events a turn may
# log between them (a trajectory note, an error) fit well within this.
_USAGE_LOOKBACK = 32


async def ended_turn(eventlog: EventLog, task_id: str, last: LastEvent | None) -> EndedTurn | None:
    """The turn whose end is the task's last event, and its final usage.

    A turn logs its end before it records its totals on its row (see
    :func:`settle`); between the two, the totals are read from the log so
    ``GET /tasks/{id}`` right after the stream ends already counts the turn.
    """
    event = last.event if last is not None else None
    if last is None or not isinstance(event, ThreadLifecycle):
        return None
    if event.phase not in TERMINAL_PHASES or event.turn_id is None:
        return None
    entries = await eventlog.redis.xrevrange(
        eventlog.keys.events(task_id), max=str(last.seq), count=_USAGE_LOOKBACK
    )
    for _entry_id, fields in entries:
        logged = parse_event(fields["d"])
        if logged.turn_id != event.turn_id:
            break
        if isinstance(logged, Usage) and logged.subagent is None:  # not a subagent's
            usage = {name: getattr(logged, name) for name in USAGE_COUNTS}
            return EndedTurn(event.turn_id, usage, round(logged.active_seconds * 1000))
    return None


def settle_turn(turn: dict[str, Any], last: LastEvent | None) -> dict[str, Any]:
    """The current turn as its log tells it: one whose end is logged but not
    yet on its row (see :func:`settle`) reads as ended."""
    event = last.event if last is not None else None
    if (
        turn["status"] not in ("queued", "running")
        or not isinstance(event, ThreadLifecycle)
        or event.phase not in TERMINAL_PHASES
        or event.turn_id != turn["turn_id"]
    ):
        return turn
    status = "cancelled" if event.stop_reason == "cancelled" else event.phase
    return {**turn, "status": status, "stop_reason": event.stop_reason}


# -- the conversation ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConversationPage:
    messages: list[dict[str, Any]]
    forks: list[dict[str, Any]]
    next_after: int | None


async def conversation(
    session: AsyncSession, task_id: str, *, every_branch: bool, after: int, limit: int
) -> ConversationPage:
    """The task's messages with id > ``after``, in order: the current branch,
    or (``every_branch``) every message, each naming the fork that took it
    off (None: current), with those forks. Messages still waiting for the
    task (``on_busy``) are not part of the conversation yet."""
    waiting = select(Turn.id).where(Turn.task_id == task_id, Turn.status.in_(PENDING))
    query = (
        select(
            Message.id,
            Message.turn_id,
            Message.role,
            Message.position,
            Message.content,
            Message.created_at,
            Message.taken_off_by,
        )
        .where(Message.task_id == task_id, Message.id > after, Message.turn_id.not_in(waiting))
        .order_by(Message.id)
        .limit(limit + 1)
    )
    if not every_branch:
        query = query.where(ON_CURRENT_BRANCH)
    rows = (await session.execute(query)).all()
    messages = [
        {
            "id": r[0],
            "turn_id": r[1],
            "role": r[2],
            "position": r[3],
            "content": r[4],
            "created_at": _ms_iso(r[5]),
            **({"fork_id": r[6]} if every_branch else {}),
        }
        for r in rows[:limit]
    ]
    forks: list[dict[str, Any]] = []
    if every_branch:
        found = await session.execute(
            select(ConversationFork)
            .where(ConversationFork.task_id == task_id)
            .order_by(ConversationFork.created_at, ConversationFork.id)
        )
        forks = [
            {
                "id": f.id,
                "reason": f.reason,
                "after_message_id": f.after_message_id,
                "created_at": _ms_iso(f.created_at),
            }
            for f in found.scalars()
        ]
    more = len(rows) > limit
    return ConversationPage(messages, forks, messages[-1]["id"] if more else None)
