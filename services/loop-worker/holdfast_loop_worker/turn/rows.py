"""The SQL of a turn's end: what its rows say once it is over."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from holdfast_shared.db.models import HitlRequestRecord, Task, Turn
from sqlalchemy import UpdateBase, select, update
from sqlalchemy.ext.asyncio import AsyncSession


def end_statements(
    *,
    task_id: str,
    turn_id: str,
    status: str,
    stop_reason: str | None,
    usage: dict[str, int],
    active_ms: int,
    working_memory: dict[str, Any],
    calibration: float,
    result: dict[str, Any] | None = None,
) -> list[UpdateBase]:
    """The turn's row, its task's learned state and its open questions, at its end
    (``result``: an output schema's validated answer, as ``{"value": ...}``)."""
    # Set only with one: a JSON null is a result too, SQL NULL is none.
    answer = {} if result is None else {"result": result["value"]}
    return [
        update(Turn)
        .where(Turn.id == turn_id)
        .values(
            status=status,
            stop_reason=stop_reason,
            finished_at=datetime.now(UTC),
            lease_owner=None,
            lease_until=None,
            # The totals GET /tasks/{task_id} sums, committed with the end.
            usage=dict(usage),
            active_ms=active_ms,
            **answer,
        ),
        # The task keeps what the context engine learned for its next turn.
        update(Task)
        .where(Task.id == task_id)
        .values(working_memory=working_memory, token_calibration=calibration),
        # A question nobody will read the answer to is closed with the turn.
        update(HitlRequestRecord)
        .where(HitlRequestRecord.turn_id == turn_id, HitlRequestRecord.status == "pending")
        .values(status="cancelled"),
    ]


@dataclass(frozen=True, slots=True)
class TurnToRun:
    """The turn's row, with what its task's row says."""

    row: Turn
    task_name: str
    # What the task's last turn left: its working memory and token calibration.
    stored_memory: dict[str, Any] | None
    stored_calibration: float | None
    # The task that delegated to this one (a subagent's), if any.
    parent_task_id: str | None


async def turn_to_run(session: AsyncSession, turn_id: str) -> TurnToRun | None:
    """The turn's row and its task's; None when its task was deleted."""
    found = (
        await session.execute(
            select(
                Turn, Task.name, Task.working_memory, Task.token_calibration, Task.parent_task_id
            )
            .join(Task, Task.id == Turn.task_id)
            .where(Turn.id == turn_id)
        )
    ).first()
    if found is None:
        return None
    return TurnToRun(*found)
