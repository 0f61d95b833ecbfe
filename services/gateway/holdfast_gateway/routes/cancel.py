"""``POST /execute/cancel``: stop a task's running turn now.

The turn ends with ``thread_lifecycle`` ``completed`` and ``stop_reason:
"cancelled"`` (after ``content_block_stop`` for any block the model had
open); its running tools are killed. A turn parked on a question is ended
the same way by the worker that picks up the queued job.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.jobs import TurnJob
from pydantic import BaseModel, ConfigDict, Field

from holdfast_gateway.deps import StateDep, TenantDep, require_task
from holdfast_gateway.errors import ApiError

router = APIRouter()


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
    keys = state.keys
    # The flag covers a turn between workers; the message stops a running one
    # at once; the job wakes a parked one.
    await state.redis.set(keys.cancel(task.id), turn_id, ex=3600)
    await state.redis.publish(keys.cancels, f"{task.id} {turn_id}")
    await state.redis.xadd(keys.turns, TurnJob.resuming(tenant, task.id, turn_id).to_fields())
    return {"status": "cancelling", "task_id": task.name, "turn_id": turn_id}
