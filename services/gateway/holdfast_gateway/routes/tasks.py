"""``/tasks/{task_id}``: remove a task (its history, log and workspace); read its
working memory."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from holdfast_shared.db.models import (
    ChannelStateSnapshot,
    EventRecord,
    HitlRequestRecord,
    Task,
    ToolResultRecord,
)
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.jobs import WorkspaceRemoval
from holdfast_shared.working_memory import live_working_memory, stored_working_memory
from pydantic import BaseModel
from sqlalchemy import delete, select

from holdfast_gateway import errors
from holdfast_gateway.deps import StateDep, TenantDep, require_task
from holdfast_gateway.errors import ApiError

router = APIRouter()


@router.delete(
    "/tasks/{task_id}",
    summary="Delete a task with its events and workspace",
    responses=errors.responses(409),
)
async def delete_task(
    state: StateDep,
    tenant: TenantDep,
    task_id: Annotated[str, Path(pattern=ID_PATTERN)],
) -> dict[str, str]:
    task = await require_task(state, tenant, task_id)
    running = await state.lock.holder(task.id)
    if running is not None:
        raise ApiError(
            409,
            ErrorCode.TURN_IN_PROGRESS,
            f"task {task.name!r} has a running turn; cancel it or wait for it to end",
            {"task_id": task.name, "turn_id": running},
        )
    async with state.sessions.begin() as session:
        # turns and messages go with the task (ON DELETE CASCADE); the rest is
        # keyed by task id without a foreign key (they outlive Redis, not tasks).
        for model in (EventRecord, ToolResultRecord, HitlRequestRecord, ChannelStateSnapshot):
            await session.execute(delete(model).where(model.task_id == task.id))
        await session.execute(delete(Task).where(Task.id == task.id))
    keys = state.keys
    await state.redis.delete(*keys.task_keys(task.id))
    await state.redis.zrem(keys.archive_dirty, task.id)
    # The workspace lives with the tool-runners: one of them removes it. The
    # name is free at once: a new task of that name gets a new id, so its
    # workspace is another directory and this removal can never reach it.
    removal = WorkspaceRemoval(tenant_id=tenant, task_id=task.id)
    await state.redis.xadd(keys.tools, removal.to_fields())
    return {"status": "deleted", "task_id": task.name}


class WorkingMemory(BaseModel):
    task_id: str
    working_memory: dict[str, str]


@router.get(
    "/tasks/{task_id}/working-memory",
    summary="The task's working memory: the notes its agent keeps (key → value)",
)
async def working_memory(
    state: StateDep,
    tenant: TenantDep,
    task_id: Annotated[str, Path(pattern=ID_PATTERN)],
) -> WorkingMemory:
    task = await require_task(state, tenant, task_id)
    # The live copy while the task is active; what its last turn left after that.
    memory = await live_working_memory(state.redis, state.keys, task.id)
    if memory is None:
        async with state.sessions() as session:
            stored = await session.scalar(select(Task.working_memory).where(Task.id == task.id))
        memory = stored_working_memory(stored)
    return WorkingMemory(task_id=task.name, working_memory=memory)
