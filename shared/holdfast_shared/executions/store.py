"""Executions in PostgreSQL: reading them as the wire object, recording
checkpoints, and the status changes the gateway and the loop-worker make.

Status follows the execution's turn: ``running`` while it is queued, runs or
waits for a human; ``paused`` once the loop-worker parked it on a pause
request; ``completed`` / ``failed`` / ``terminated`` when it ended completed /
errored (after its retries) / cancelled. The loop-worker writes these where
the turn parks or ends, so the row is never derived at read time alone.

Active time: ``active_ms`` is what was counted up to the last pause or end;
while running, the time since ``running_since`` adds to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.branches import ON_CURRENT_BRANCH
from holdfast_shared.db.models import (
    ChannelStateSnapshot,
    Execution,
    ExecutionCheckpoint,
    Message,
    Task,
    Turn,
)
from holdfast_shared.executions.wire import CheckpointOut, ExecutionOut, Status
from holdfast_shared.ids import new_id

FINISHED: frozenset[str] = frozenset({"completed", "failed", "terminated"})


def iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def elapsed_ms(row: Execution, now: datetime) -> int:
    """Active time: paused time (and time after the end) excluded."""
    live = 0
    if row.running_since is not None:
        live = max(0, int((now - row.running_since).total_seconds() * 1000))
    return row.active_ms + live


def to_wire(
    row: Execution,
    checkpoints: Sequence[ExecutionCheckpoint],
    now: datetime,
    result: Any = None,
) -> ExecutionOut:
    status: Status = row.status  # type: ignore[assignment]  # the column holds a Status
    return ExecutionOut(
        id=row.id,
        name=row.name,
        description=row.description,
        agent_id=row.agent_id,
        task_type=row.task_type,
        status=status,
        state=row.state,
        checkpoints=[checkpoint_out(c) for c in checkpoints],
        config=row.config,
        elapsed_seconds=elapsed_ms(row, now) // 1000,
        started_at=iso(row.started_at),
        completed_at=iso(row.completed_at) if row.completed_at else None,
        updated_at=iso(row.updated_at),
        failure_reason=row.failure_reason,
        attempts=row.attempts,
        result=result,
    )


def checkpoint_out(row: ExecutionCheckpoint) -> CheckpointOut:
    return CheckpointOut(id=row.id, label=row.label, state=row.state, timestamp=iso(row.created_at))


async def find(session: AsyncSession, tenant_id: str, execution_id: str) -> Execution | None:
    """The tenant's execution (None for another tenant's)."""
    return await session.scalar(
        select(Execution).where(Execution.id == execution_id, Execution.tenant_id == tenant_id)
    )


async def of_task(session: AsyncSession, task_id: str) -> Execution | None:
    """The execution a task (engine id) runs, if it is one."""
    return await session.scalar(select(Execution).where(Execution.task_id == task_id))


async def checkpoints_of(
    session: AsyncSession, execution_ids: Sequence[str]
) -> dict[str, list[ExecutionCheckpoint]]:
    """The checkpoints of these executions, oldest first."""
    found: dict[str, list[ExecutionCheckpoint]] = {e: [] for e in execution_ids}
    if not execution_ids:
        return found
    rows = await session.scalars(
        select(ExecutionCheckpoint)
        .where(ExecutionCheckpoint.execution_id.in_(execution_ids))
        .order_by(ExecutionCheckpoint.created_at, ExecutionCheckpoint.id)
    )
    for row in rows:
        found[row.execution_id].append(row)
    return found


async def results_of(session: AsyncSession, rows: Sequence[Execution]) -> dict[str, Any]:
    """The structured result (``output_schema``) of each execution's turn, by
    execution id; an execution without one is left out."""
    turns = {row.turn_id: row.id for row in rows if row.turn_id}
    if not turns:
        return {}
    found = await session.execute(
        select(Turn.id, Turn.result).where(Turn.id.in_(turns), Turn.result.is_not(None))
    )
    return {turns[turn_id]: result for turn_id, result in found.tuples()}


async def latest_checkpoint(session: AsyncSession, execution_id: str) -> ExecutionCheckpoint | None:
    return await session.scalar(
        select(ExecutionCheckpoint)
        .where(ExecutionCheckpoint.execution_id == execution_id)
        .order_by(ExecutionCheckpoint.created_at.desc(), ExecutionCheckpoint.id.desc())
        .limit(1)
    )


async def turn_position(
    session: AsyncSession, task_id: str, turn_id: str | None
) -> tuple[dict[str, Any] | None, int | None]:
    """The turn's latest live snapshot and the last message of the task's current
    conversation, read in one statement so the two agree (a step's message and
    its snapshot commit together)."""
    last_message = (
        select(func.max(Message.id))
        .where(Message.task_id == task_id, ON_CURRENT_BRANCH)
        .scalar_subquery()
    )
    snapshot = (
        select(ChannelStateSnapshot.state)
        .where(
            ChannelStateSnapshot.turn_id == (turn_id or ""),
            ChannelStateSnapshot.expires_at > datetime.now(UTC),
        )
        .order_by(ChannelStateSnapshot.id.desc())
        .limit(1)
        .scalar_subquery()
    )
    row = (await session.execute(select(snapshot, last_message))).one()
    return row[0], row[1]


async def add_checkpoint(
    session: AsyncSession,
    execution: Execution,
    *,
    label: str | None,
    state: dict[str, Any],
    turn_state: dict[str, Any] | None,
    last_message_id: int | None,
    working_memory: dict[str, Any] | None,
    workspace_archive_id: str | None,
    automatic: bool,
) -> ExecutionCheckpoint:
    checkpoint = ExecutionCheckpoint(
        id=new_id("ckpt"),
        execution_id=execution.id,
        label=label,
        state=state,
        turn_id=execution.turn_id,
        turn_state=turn_state,
        last_message_id=last_message_id,
        working_memory=working_memory,
        workspace_archive_id=workspace_archive_id,
        automatic=automatic,
        created_at=datetime.now(UTC),
    )
    session.add(checkpoint)
    values: dict[str, Any] = {"updated_at": func.now()}
    if automatic:
        values["last_checkpoint_at"] = checkpoint.created_at
    await session.execute(update(Execution).where(Execution.id == execution.id).values(**values))
    await session.flush()
    return checkpoint


# -- status changes ---------------------------------------------------------------


async def lock_for_pause(session: AsyncSession, task_id: str) -> None:
    """Hold the task's row and its execution's until ``session`` ends: a worker
    parking its turn on a pause and a resume withdrawing that pause take one of
    them (an execution's resume its execution row, a subagent's resume its
    task's row), so the parking worker reads the pause request (``Keys.pause``)
    either before the resume or after it withdrew it, never in between (a pause
    taken back by a resume the client was told succeeded)."""
    await session.execute(select(Task.id).where(Task.id == task_id).with_for_update(key_share=True))
    await session.execute(
        select(Execution.id).where(Execution.task_id == task_id).with_for_update()
    )


async def mark_paused(session: AsyncSession, task_id: str, turn_active_ms: int) -> None:
    """The loop-worker parked the turn on a pause request.

    ``turn_active_ms`` is the turn's own count of its active time (snapshots
    carry it); an execution has one turn, so that is the execution's too.
    """
    now = datetime.now(UTC)
    await session.execute(
        update(Execution)
        .where(Execution.task_id == task_id, Execution.status.in_(("running", "paused")))
        .values(
            status="paused",
            paused_at=func.coalesce(Execution.paused_at, now),
            running_since=None,
            active_ms=turn_active_ms,
            updated_at=now,
        )
    )


async def mark_running(session: AsyncSession, execution_id: str, *, from_status: str) -> bool:
    """``from_status`` → running (False when it was not in that status: a race lost)."""
    now = datetime.now(UTC)
    changed = await session.scalar(
        update(Execution)
        .where(Execution.id == execution_id, Execution.status == from_status)
        .values(status="running", paused_at=None, running_since=now, updated_at=now)
        .returning(Execution.id)
    )
    return changed is not None


async def count_attempt(
    session: AsyncSession, execution_id: str, *, max_attempts: int
) -> int | None:
    """Count one more attempt of a running execution; the attempts before it, or
    None when none is left (or it is not running any more)."""
    attempt: int | None = await session.scalar(
        update(Execution)
        .where(
            Execution.id == execution_id,
            Execution.status == "running",
            Execution.attempts < max_attempts,
        )
        .values(attempts=Execution.attempts + 1, failure_reason=None)
        .returning(Execution.attempts)
    )
    return attempt


async def claimable_again(
    session: AsyncSession, turn_id: str, *, from_statuses: Sequence[str] = ("paused",)
) -> bool:
    """A turn no worker holds (paused, or parked) made claimable by the next
    worker that takes its job: a resume, or a cancel that worker carries out.
    False when it was in none of ``from_statuses`` (running, or ended)."""
    changed = await session.scalar(
        update(Turn)
        .where(Turn.id == turn_id, Turn.status.in_(from_statuses))
        .values(status="running", lease_owner=None, lease_until=None)
        .returning(Turn.id)
    )
    return changed is not None


async def mark_ended(
    session: AsyncSession,
    task_id: str,
    status: Status,
    *,
    turn_active_ms: int | None,
    reason: str | None = None,
) -> None:
    now = datetime.now(UTC)
    values: dict[str, Any] = {
        "status": status,
        "completed_at": now,
        "updated_at": now,
        "running_since": None,
        "failure_reason": reason,
    }
    if turn_active_ms is not None:
        values["active_ms"] = turn_active_ms
    else:
        # Ended without a worker (a paused one deleted): what ran so far counts.
        values["active_ms"] = Execution.active_ms + func.coalesce(
            func.floor(func.extract("epoch", now - Execution.running_since) * 1000), 0
        )
    await session.execute(
        update(Execution)
        .where(Execution.task_id == task_id, Execution.status.not_in(FINISHED))
        .values(**values)
    )
