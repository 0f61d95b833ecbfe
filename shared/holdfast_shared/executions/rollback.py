"""Rolling an execution back to a checkpoint: conversation, state, turn and files.

Used by ``POST /v1/execution/{id}/resume`` with a ``checkpoint_id`` (gateway)
and by a retry after a failed step (loop-worker). The caller holds the task
still: its turn is paused or ended, and the task's turn lock is held, so no
turn writes messages meanwhile (what ``branches.take_off_after`` asks).

What goes back, in this order:

1. the workspace's files — a tool-runner restores the checkpoint's archive
   (none: an empty workspace). First, because it is the step that can fail
   for reasons outside PostgreSQL (no runner answers); nothing else changed
   yet when it does;
2. a ``turn_resumed`` event with reason ``rollback``: the log is append-only,
   so a reader learns there that what follows continues from a checkpoint;
3. in one transaction: the messages after the checkpoint's last one leave the
   current branch (a ``rollback`` fork; they stay readable), the checkpoint's
   turn state becomes the turn's latest snapshot, the execution's state
   document and the task's working memory return to the checkpoint's.

The restored snapshot keeps today's counters where going back would lie:
usage and active time (spent, whatever was rolled back), ``last_seq`` (the
rollback event: what the log holds before it is not this run's to
replay) and ``position`` (past every message the turn stored, so new
messages never land on a taken-off one's slot). Tool calls the checkpoint had
not yet run lose their stored outcomes: after a rollback they run again,
against the restored files.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_shared.branches import take_off_after
from holdfast_shared.db.models import (
    ChannelStateSnapshot,
    Execution,
    ExecutionCheckpoint,
    HitlRequestRecord,
    Message,
    Task,
    ToolResultRecord,
)
from holdfast_shared.eventlog import EventLog
from holdfast_shared.events import TurnResumed
from holdfast_shared.keys import Keys
from holdfast_shared.workspace_checkpoints.requests import restore_workspace


@dataclass(frozen=True, slots=True)
class RollbackTarget:
    """Where to go back to: a checkpoint, or (None) the execution's start."""

    checkpoint: ExecutionCheckpoint | None


async def roll_back(
    *,
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    keys: Keys,
    eventlog: EventLog,
    execution: Execution,
    task_name: str,
    target: RollbackTarget,
    snapshot_ttl: timedelta,
    workspace_timeout: float = 30.0,
) -> None:
    """Put the execution back to ``target`` (see the module docstring).

    Raises ``WorkspaceRequestError`` (nothing changed) when the files could
    not be restored.
    """
    checkpoint = target.checkpoint
    turn_id = execution.turn_id
    if turn_id is None:
        raise ValueError(f"execution {execution.id} has no turn")
    await restore_workspace(
        redis,
        keys,
        tenant_id=execution.tenant_id,
        task_id=execution.task_id,
        archive_id=checkpoint.workspace_archive_id if checkpoint else None,
        timeout=workspace_timeout,
    )
    appended = await eventlog.append(
        execution.task_id, turn_id, [TurnResumed(reason="rollback")], name=task_name
    )
    async with sessions.begin() as session:
        last_kept = checkpoint.last_message_id if checkpoint else None
        if last_kept is None:
            # The start: only the turn's opening message stays.
            last_kept = await session.scalar(
                select(Message.id).where(Message.turn_id == turn_id, Message.position == 0)
            )
        await take_off_after(session, execution.task_id, last_kept, reason="rollback")
        current = await session.scalar(
            select(ChannelStateSnapshot.state)
            .where(ChannelStateSnapshot.turn_id == turn_id)
            .order_by(ChannelStateSnapshot.id.desc())
            .limit(1)
        )
        top = await session.scalar(
            select(func.max(Message.position)).where(Message.turn_id == turn_id)
        )
        state = _restored_state(
            checkpoint.turn_state if checkpoint else None,
            current or {},
            working_memory=_notes(checkpoint.working_memory if checkpoint else {}),
            last_seq=appended.last_seq,
            position=(top or 0) + 1,
        )
        rerun = [
            call["id"]
            for call in state.get("pending", [])
            if isinstance(call, dict) and call.get("outcome") is None
        ]
        if rerun:
            await session.execute(
                delete(ToolResultRecord).where(
                    ToolResultRecord.task_id == execution.task_id,
                    ToolResultRecord.tool_call_id.in_(rerun),
                )
            )
        # A question the turn waited on belongs to the run being rolled back.
        await session.execute(
            update(HitlRequestRecord)
            .where(HitlRequestRecord.turn_id == turn_id, HitlRequestRecord.status == "pending")
            .values(status="cancelled")
        )
        session.add(
            ChannelStateSnapshot(
                task_id=execution.task_id,
                turn_id=turn_id,
                reason="rollback",
                state=state,
                expires_at=datetime.now(UTC) + snapshot_ttl,
            )
        )
        values: dict[str, Any] = {"updated_at": func.now()}
        if checkpoint is not None:
            values["state"] = checkpoint.state
        await session.execute(
            update(Execution).where(Execution.id == execution.id).values(**values)
        )
        await session.execute(
            update(Task)
            .where(Task.id == execution.task_id)
            .values(working_memory=state["working_memory"])
        )
    # The live copy too: a turn that starts later (not this one, which
    # publishes its snapshot's) reads Redis first.
    await redis.delete(keys.working_memory(execution.task_id))


def _notes(stored: dict[str, Any] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (stored or {}).items()}


def _restored_state(
    at_checkpoint: dict[str, Any] | None,
    current: dict[str, Any],
    *,
    working_memory: dict[str, str],
    last_seq: int,
    position: int,
) -> dict[str, Any]:
    """The turn state to continue from: the checkpoint's loop position, today's
    counters. A checkpoint taken before the turn's first snapshot starts the
    loop over."""
    base: dict[str, Any] = (
        dict(at_checkpoint)
        if at_checkpoint is not None
        else {"stage": "model", "iteration": 0, "pending": [], "stop_reason": None}
    )
    for kept in ("usage", "active_ms", "calibration"):
        if kept in current:
            base[kept] = current[kept]
    base["last_seq"] = last_seq
    base["position"] = max(position, int(base.get("position", 1)))
    base["working_memory"] = working_memory
    return base
