"""``POST /execute/cancel``: stop a task's running turn now.

The turn ends with ``thread_lifecycle`` ``completed`` and ``stop_reason:
"cancelled"`` (after ``content_block_stop`` for any block the model had
open); its running tools are killed. A turn parked on a question, or paused,
is ended the same way by the worker that picks up the queued job
(``cancelling.py``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from pydantic import BaseModel, ConfigDict, Field

from holdfast_gateway.cancelling import request_cancel
from holdfast_gateway.deps import StateDep, TenantDep, require_task
from holdfast_gateway.errors import ApiError

router = APIRouter(tags=["execute"])


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: Annotated[str, Field(pattern=ID_PATTERN)]


@router.post("/execute/cancel", summary="Stop the task's running turn")
async def cancel(
    state: StateDep, tenant: TenantDep, body: Annotated[CancelRequest, Body()]
) -> dict[str, str]:
    task = await require_task(state, tenant, body.task_id)
    turn_id = await state.lock.holder(task.id)
    if turn_id is None:
        raise ApiError(409, ErrorCode.NO_RUNNING_TURN, f"task {task.name!r} has no running turn")
    await request_cancel(state, tenant, task.id, turn_id)
    return {"status": "cancelling", "task_id": task.name, "turn_id": turn_id}
