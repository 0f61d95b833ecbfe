"""A finished turn's trajectory: what the learning centre learns from.

Written by the statement that records the turn's end, so a turn that ended
has its trajectory (and one only: the row's id is the turn's id). The
announcement on ``Keys.trajectories`` follows the commit; if the worker dies
in between, the learning service's sweep finds the row still pending and
announces it itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from holdfast_shared.db.models import (
    HitlRequestRecord,
    Message,
    ToolResultRecord,
    TrajectoryRecord,
)
from holdfast_shared.jobs import TrajectoryReady
from holdfast_shared.keys import Keys
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import Row, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.dml import Insert

log = logging.getLogger(__name__)

# The record's layout; the learning centre reads older versions too.
VERSION = 1


@dataclass(frozen=True, slots=True)
class TurnEnding:
    """How the turn ended and what it ran with."""

    tenant_id: str
    user_id: str
    task_id: str
    task_name: str | None
    turn_id: str
    agent: str | None
    model: str | None
    status: str  # completed | errored | cancelled
    stop_reason: str | None
    error: dict[str, Any] | None
    usage: dict[str, int]
    active_ms: int
    started_at: datetime | None  # the turn row's created_at


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


async def trajectory_insert(session: AsyncSession, ending: TurnEnding) -> Insert:
    """Read what the turn did; returns the statement that stores its trajectory
    (which does nothing when it is stored already).

    The turn's end closes its pending questions in the same statement as this
    insert, which sees the rows as they were before it: they are recorded as
    ``cancelled`` here.
    """
    turn_id = ending.turn_id
    messages, calls, questions = await _read(session, ending)
    finished = datetime.now(UTC)
    started = ending.started_at or finished
    record = {
        "version": VERSION,
        "task": {"id": ending.task_id, "name": ending.task_name},
        "turn_id": turn_id,
        "agent": ending.agent,
        "model": ending.model,
        "messages": [
            {"position": m.position, "role": m.role, "content": m.content, "at": _iso(m.created_at)}
            for m in messages
        ],
        "tool_calls": [_tool_call(c) for c in calls],
        "hitl": [_question(q) for q in questions],
        "usage": ending.usage,
        "timings": {
            "started_at": _iso(started),
            "finished_at": _iso(finished),
            "active_ms": ending.active_ms,
            "wall_ms": int((finished - started).total_seconds() * 1000),
        },
        "outcome": {
            "status": ending.status,
            "stop_reason": ending.stop_reason,
            "error": ending.error,
        },
    }
    return (
        insert(TrajectoryRecord)
        .values(
            id=turn_id,
            tenant_id=ending.tenant_id,
            user_id=ending.user_id,
            task_id=ending.task_id,
            outcome=ending.status,
            record=record,
            started_at=started,
            finished_at=finished,
        )
        .on_conflict_do_nothing(index_elements=[TrajectoryRecord.id])
    )


async def _read(
    session: AsyncSession, ending: TurnEnding
) -> tuple[Sequence[Row[Any]], Sequence[ToolResultRecord], Sequence[HitlRequestRecord]]:
    """The turn's messages, tool calls and questions, in order."""
    turn_id = ending.turn_id
    messages = (
        await session.execute(
            select(Message.position, Message.role, Message.content, Message.created_at)
            .where(Message.turn_id == turn_id)
            .order_by(Message.position)
        )
    ).all()
    calls = (
        (
            await session.execute(
                select(ToolResultRecord)
                .where(ToolResultRecord.task_id == ending.task_id)
                .where(ToolResultRecord.turn_id == turn_id)
                .order_by(ToolResultRecord.started_at)
            )
        )
        .scalars()
        .all()
    )
    questions = (
        (
            await session.execute(
                select(HitlRequestRecord)
                .where(HitlRequestRecord.turn_id == turn_id)
                .order_by(HitlRequestRecord.created_at)
            )
        )
        .scalars()
        .all()
    )
    return messages, calls, questions


def _tool_call(c: ToolResultRecord) -> dict[str, Any]:
    return {
        "id": c.tool_call_id,
        "tool": c.tool,
        "input": c.input,
        "output": c.output,
        "error": c.error,
        "started_at": _iso(c.started_at),
        "finished_at": _iso(c.finished_at),
    }


def _question(q: HitlRequestRecord) -> dict[str, Any]:
    # Still pending: the statement that stores the trajectory closes it (turn/rows.py).
    return {
        "request_id": q.request_id,
        "kind": q.kind,
        "question": q.question,
        "status": "cancelled" if q.status == "pending" else q.status,
        "answer": q.answer,
        "feedback": q.feedback,
        "asked_at": _iso(q.created_at),
        "answered_at": _iso(q.answered_at),
    }


async def announce(redis: Redis, keys: Keys, tenant_id: str, turn_id: str) -> None:
    """Tell the learning service (again is harmless: learning is idempotent by id).

    A Redis that cannot take it now is no reason to fail a turn that has
    ended: the learning service's sweep learns a trajectory nobody announced.
    """
    ready = TrajectoryReady(trajectory_id=turn_id, tenant_id=tenant_id)
    try:
        # Trimmed so that acknowledged announcements do not pile up; one trimmed
        # before it was read is learned by the sweep too.
        await redis.xadd(keys.trajectories, ready.to_fields(), maxlen=100_000, approximate=True)
    except RedisError as exc:
        log.warning("trajectory %s not announced (%s); the sweep will learn it", turn_id, exc)
