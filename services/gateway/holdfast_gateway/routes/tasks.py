"""``/tasks``: a tenant's tasks and what each is doing (status, turns, usage,
pending question, last event), a task's conversation with its branches;
remove a task (its history, log and workspace); read its working memory.

The reads are in ``taskstatus.py``; they derive everything from committed
rows, so they are as right after a crash as before it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
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
from holdfast_shared.turnqueue import count_pending
from holdfast_shared.working_memory import live_working_memory, stored_working_memory
from pydantic import BaseModel
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway import errors, taskstatus
from holdfast_gateway.deps import StateDep, TenantDep, require_task
from holdfast_gateway.errors import ApiError
from holdfast_gateway.tasks import lock_task, with_subagents
from holdfast_gateway.taskstatus import BadCursor, TaskStatus

router = APIRouter(tags=["tasks"])


@router.delete(
    "/tasks/{task_id}",
    summary="Delete a task with its events and workspace, and its subagents' tasks",
    responses=errors.responses(409),
)
async def delete_task(
    state: StateDep,
    tenant: TenantDep,
    task_id: Annotated[str, Path(pattern=ID_PATTERN)],
) -> dict[str, str]:
    async with state.sessions.begin() as session:
        # The task's row is locked first, as start_turn and the on_busy queue
        # lock it before they take the turn lock or write a turn: a turn they
        # committed is seen here, and none is written for a task deleted here.
        task = await lock_task(session, tenant, task_id, deleting=True)
        if task is None:
            raise ApiError(404, ErrorCode.TASK_NOT_FOUND, f"task {task_id!r} not found")
        running = await state.lock.holder(task.id)
        if running is not None:
            raise ApiError(
                409,
                ErrorCode.TURN_IN_PROGRESS,
                f"task {task.name!r} has a running turn; cancel it or wait for it to end",
                {"task_id": task.name, "turn_id": running},
            )
        waiting = await count_pending(session, task.id)
        if waiting:
            # Accepted messages (on_busy) wait for the task: deleting it would drop them.
            raise ApiError(
                409,
                ErrorCode.TURN_IN_PROGRESS,
                f"task {task.name!r} has {waiting} messages waiting to run; wait for them to end",
                {"task_id": task.name, "queued": waiting},
            )
        # Its subagents' tasks go with it (a parent's end cancels their turns;
        # one still ending is waited for, as the task's own would be).
        children = await subagent_tasks(session, task.id)
        for child_id, child_name in children:
            busy = await state.lock.holder(child_id)
            if busy is not None:
                raise ApiError(
                    409,
                    ErrorCode.TURN_IN_PROGRESS,
                    f"task {task.name!r} has a subagent task {child_name!r} whose turn is "
                    "still running; wait for it to end",
                    {"task_id": task.name, "subagent_task_id": child_name, "turn_id": busy},
                )
        ids = [task.id, *(child_id for child_id, _ in children)]
        # turns and messages go with the task (ON DELETE CASCADE); the rest is
        # keyed by task id without a foreign key (they outlive Redis, not tasks).
        for model in (EventRecord, ToolResultRecord, HitlRequestRecord, ChannelStateSnapshot):
            await session.execute(delete(model).where(model.task_id.in_(ids)))
        await session.execute(delete(Task).where(Task.id.in_(ids)))
    keys = state.keys
    for gone in ids:
        await state.redis.delete(*keys.task_keys(gone))
        await state.redis.zrem(keys.archive_dirty, gone)
        # The workspace lives with the tool-runners: one of them removes it. The
        # name is free at once: a new task of that name gets a new id, so its
        # workspace is another directory and this removal can never reach it.
        removal = WorkspaceRemoval(tenant_id=tenant, task_id=gone)
        await state.redis.xadd(keys.tools, removal.to_fields())
    return {"status": "deleted", "task_id": task.name}


async def subagent_tasks(session: AsyncSession, task_id: str) -> list[tuple[str, str]]:
    """The ids and names of the task's subagents' tasks, at any depth, their rows
    locked (a delegation starting one meanwhile waits, then finds its parent gone)."""
    rows = await session.execute(
        select(Task.id, Task.name)
        .where(Task.id.in_(with_subagents(task_id)), Task.id != task_id)
        .with_for_update()
    )
    return [(row[0], row[1]) for row in rows.all()]


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


# -- status ----------------------------------------------------------------------

TaskPath = Annotated[str, Path(pattern=ID_PATTERN)]


class TaskSummary(BaseModel):
    task_id: str
    status: TaskStatus
    agent: str | None
    model: str | None
    turn_count: int
    created_at: datetime
    updated_at: datetime


class TaskPage(BaseModel):
    tasks: list[TaskSummary]
    next_cursor: str | None


@router.get(
    "/tasks",
    summary="The tenant's tasks, newest activity first, with their status",
)
async def list_tasks(
    state: StateDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[
        str | None,
        Query(max_length=512, description="next_cursor of the previous page"),
    ] = None,
    status: Annotated[TaskStatus | None, Query(description="only tasks in this status")] = None,
) -> TaskPage:
    async with state.sessions() as session:
        try:
            rows, next_cursor = await taskstatus.list_tasks(
                session, tenant, limit=limit, cursor=cursor, status=status
            )
        except BadCursor:
            details = {
                "errors": [
                    {
                        "loc": ["query", "cursor"],
                        "msg": "not a cursor of this list",
                        "type": "unknown_cursor",
                    }
                ]
            }
            raise ApiError(
                422,
                ErrorCode.INVALID_REQUEST,
                "invalid request: cursor: not a cursor of this list",
                details,
            ) from None
    tasks = []
    for r in rows:
        settled = await taskstatus.settle(state.lock, r.id, r.status)
        # The rows' status is settled against the turn lock (a turn that just
        # ended): with a filter, a page may be short, never wrong.
        if status is None or settled == status:
            tasks.append(
                TaskSummary(
                    task_id=r.name,
                    status=settled,
                    agent=r.agent,
                    model=r.model,
                    turn_count=r.turn_count,
                    created_at=r.created_at,
                    updated_at=r.updated_at,
                )
            )
    return TaskPage(tasks=tasks, next_cursor=next_cursor)


class TaskUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    reasoning_tokens: int
    active_seconds: float


class LastResult(BaseModel):
    turn_id: str
    # The validated answer (any JSON value the turn's output_schema allows).
    result: Any
    finished_at: datetime | None


class TaskState(BaseModel):
    task_id: str
    status: TaskStatus
    agent: str | None
    model: str | None
    created_at: datetime
    updated_at: datetime
    turn_count: int
    current_turn: dict[str, Any] | None
    usage: TaskUsage
    pending_hitl: dict[str, Any] | None
    last_seq: int | None
    last_event_at: int | None
    # The latest structured result (a turn with output_schema that completed).
    last_result: LastResult | None = None


@router.get(
    "/tasks/{task_id}",
    summary="A task's status, turns, usage totals, pending question and last event",
)
async def get_task(state: StateDep, tenant: TenantDep, task_id: TaskPath) -> TaskState:
    task = await require_task(state, tenant, task_id)
    async with state.sessions() as session:
        last = await taskstatus.last_event(state.eventlog, session, task.id)
        ended = await taskstatus.ended_turn(state.eventlog, task.id, last)
        detail = await taskstatus.task_detail(session, task.id, ended)
        result = await taskstatus.last_result(session, task.id)
    if detail is None:  # deleted meanwhile
        raise ApiError(404, ErrorCode.TASK_NOT_FOUND, f"task {task_id!r} not found")
    return TaskState(
        task_id=detail.name,
        status=await taskstatus.settle(state.lock, task.id, detail.status),
        agent=detail.agent,
        model=detail.model,
        created_at=detail.created_at,
        updated_at=detail.updated_at,
        turn_count=detail.turn_count,
        current_turn=(
            None
            if detail.current_turn is None
            else taskstatus.settle_turn(detail.current_turn, last)
        ),
        usage=TaskUsage(**detail.usage),
        pending_hitl=detail.pending_hitl,
        last_seq=last.seq if last else None,
        last_event_at=last.timestamp if last else None,
        last_result=None if result is None else LastResult(**result),
    )


class ConversationMessage(BaseModel):
    id: int
    turn_id: str
    role: str
    position: int
    content: dict[str, Any]
    created_at: datetime
    fork_id: str | None = None


class ConversationForkOut(BaseModel):
    id: str
    reason: str
    after_message_id: int | None
    created_at: datetime


class Conversation(BaseModel):
    task_id: str
    branch: Literal["current", "all"]
    messages: list[ConversationMessage]
    forks: list[ConversationForkOut]
    next_after: int | None


@router.get(
    "/tasks/{task_id}/messages",
    summary="The task's conversation in order: the current branch, or every message",
)
async def list_messages(
    state: StateDep,
    tenant: TenantDep,
    task_id: TaskPath,
    branch: Annotated[
        Literal["current", "all"],
        Query(
            description="`all`: also the messages an edit or retry took off the branch, "
            "each with the `fork_id` that did (null: current)"
        ),
    ] = "current",
    after: Annotated[
        int, Query(ge=0, le=2**63 - 1, description="only messages with a greater id")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> Conversation:
    task = await require_task(state, tenant, task_id)
    async with state.sessions() as session:
        page = await taskstatus.conversation(
            session, task.id, every_branch=branch == "all", after=after, limit=limit
        )
    return Conversation(
        task_id=task.name,
        branch=branch,
        messages=[ConversationMessage(**m) for m in page.messages],
        forks=[ConversationForkOut(**f) for f in page.forks],
        next_after=page.next_after,
    )
