"""A parked turn whose question was answered but whose resume job was lost (a Redis
that lost its last writes, a gateway that died between the answer's commit and the
job) is found by the stale-turn sweep (``recovery.requeue_stale``), never left parked."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta

from holdfast_loop_worker.recovery import _answered_but_parked
from holdfast_shared.db.models import HitlRequestRecord, Task, Turn
from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.taskids import TENANTS


async def parked_turn(
    sessions: async_sessionmaker[AsyncSession], *requests: tuple[str, datetime | None]
) -> tuple[str, str]:
    task_id, turn_id = f"task_{secrets.token_hex(6)}", f"turn_{secrets.token_hex(6)}"
    async with sessions.begin() as session:
        session.add(Task(id=task_id, tenant_id=TENANTS["main"], name=task_id))
        await session.flush()
        session.add(Turn(id=turn_id, task_id=task_id, status="parked"))
        for status, answered_at in requests:
            session.add(
                HitlRequestRecord(
                    request_id=f"hitl_{secrets.token_hex(6)}",
                    tenant_id=TENANTS["main"],
                    task_id=task_id,
                    turn_id=turn_id,
                    kind="permission",
                    question="may I?",
                    status=status,
                    answered_at=answered_at,
                    expires_at=datetime.now(UTC) + timedelta(days=3),
                )
            )
    return task_id, turn_id


async def test_only_a_parked_turn_whose_answers_are_old_is_queued_again(
    sessions: async_sessionmaker[AsyncSession], api_keys: dict[str, str]
) -> None:
    now = datetime.now(UTC)
    stale = now - timedelta(seconds=10)
    lost = await parked_turn(sessions, ("answered", now - timedelta(minutes=1)))
    fresh = await parked_turn(sessions, ("answered", now))  # its job may be on its way
    asked_again = await parked_turn(
        sessions, ("answered", now - timedelta(minutes=2)), ("pending", None)
    )
    waiting = await parked_turn(sessions, ("pending", None))
    try:
        async with sessions.begin() as session:
            found = await _answered_but_parked(session, now, stale)
        mine = {lost, fresh, asked_again, waiting}
        assert [row for row in found if row in mine] == [lost]
        # Reserved: the next pass leaves it until it is stale again.
        async with sessions.begin() as session:
            again = await _answered_but_parked(session, now, stale)
        assert lost not in again
    finally:
        async with sessions.begin() as session:
            await session.execute(
                delete(Task).where(Task.id.in_([t for t, _ in (lost, fresh, asked_again, waiting)]))
            )
