"""Parking a turn on a pause, against what can race it (``executions.park_paused``):
a resume that withdrew the pause meanwhile, and another worker that took the
turn over after this one's lease lapsed. Real PostgreSQL and Redis; the turn is
the in-memory handle."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from holdfast_loop_worker.executions import park_paused
from holdfast_loop_worker.lease import Leases
from holdfast_loop_worker.turn_state import Snapshots
from holdfast_shared.db.models import Execution, Task, Turn
from holdfast_shared.errors import Superseded
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import Keys
from redis.asyncio import Redis
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.loop_worker.fake_turn import FakeTurn
from tests.taskids import TENANTS

WORKER = "worker-a"


@dataclass
class Context:
    """What park_paused reaches of the worker: the real stores, no tool-runner."""

    sessions: async_sessionmaker[AsyncSession]
    redis: Redis
    keys: Keys
    leases: Leases
    snapshots: Snapshots
    tools: None = None


@pytest.fixture
async def running(
    sessions: async_sessionmaker[AsyncSession], redis: Redis, api_keys: dict[str, str]
) -> AsyncIterator[tuple[Context, FakeTurn]]:
    """An execution whose turn this worker holds, streaming."""
    task_id, turn_id = f"task_{secrets.token_hex(6)}", f"turn_{secrets.token_hex(6)}"
    tenant = TENANTS["main"]
    async with sessions.begin() as session:
        session.add(Task(id=task_id, tenant_id=tenant, name=task_id))
        await session.flush()
        session.add(
            Turn(
                id=turn_id,
                task_id=task_id,
                status="running",
                lease_owner=WORKER,
                lease_until=datetime.now(UTC) + timedelta(minutes=5),
            )
        )
        session.add(
            Execution(
                id=f"exec_{secrets.token_hex(6)}",
                tenant_id=tenant,
                task_id=task_id,
                turn_id=turn_id,
                name="race",
                status="running",
                state={},
                config={},
                running_since=datetime.now(UTC),
            )
        )
    ctx = Context(
        sessions=sessions,
        redis=redis,
        keys=Keys(prefix=f"test:{secrets.token_hex(4)}:"),
        leases=Leases(sessions, WORKER, lease_seconds=30),
        snapshots=Snapshots(sessions, active_ttl_seconds=60, hitl_ttl_seconds=60),
    )
    turn = FakeTurn(job=TurnJob(task_id=task_id, turn_id=turn_id, tenant_id=tenant))
    yield ctx, turn
    await redis.delete(ctx.keys.pause(task_id))
    async with sessions.begin() as session:
        await session.execute(delete(Task).where(Task.id == task_id))


async def rows(ctx: Context, turn: FakeTurn) -> tuple[Any, ...]:
    async with ctx.sessions() as session:
        found = (
            await session.execute(
                select(Turn.status, Turn.lease_owner, Execution.status)
                .join(Execution, Execution.turn_id == Turn.id)
                .where(Turn.id == turn.job.turn_id)
            )
        ).one()
    return tuple(found)


async def test_a_pause_still_asked_for_parks_the_turn(running: tuple[Context, FakeTurn]) -> None:
    ctx, turn = running
    await ctx.redis.set(ctx.keys.pause(turn.job.task_id), turn.job.turn_id)
    assert await park_paused(turn, ctx) == "paused"  # type: ignore[arg-type]
    assert await rows(ctx, turn) == ("paused", None, "paused")
    assert turn.requeued == []


async def test_a_pause_a_resume_withdrew_hands_the_turn_on(
    running: tuple[Context, FakeTurn],
) -> None:
    # The worker read the request at its boundary; the resume deleted it before
    # the worker parked (as a late pause message cutting a resumed call does too).
    ctx, turn = running
    assert await park_paused(turn, ctx, cut=True) == "handed_back"  # type: ignore[arg-type]
    assert await rows(ctx, turn) == ("running", None, "running")
    assert [(j.turn_id, j.resume) for j in turn.requeued] == [(turn.job.turn_id, True)]


async def test_a_worker_whose_lease_was_taken_over_marks_nothing(
    running: tuple[Context, FakeTurn],
) -> None:
    ctx, turn = running
    await ctx.redis.set(ctx.keys.pause(turn.job.task_id), turn.job.turn_id)
    async with ctx.sessions.begin() as session:
        turn_row = await session.get(Turn, turn.job.turn_id)
        assert turn_row is not None
        turn_row.lease_owner = "worker-b"
    with pytest.raises(Superseded):
        await park_paused(turn, ctx)  # type: ignore[arg-type]
    # The new holder parks it (or runs on): the execution is not paused under it.
    assert await rows(ctx, turn) == ("running", "worker-b", "running")
