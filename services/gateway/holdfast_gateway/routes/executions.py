"""``/v1/execution``: long-running work with a state document, checkpoints,
pause, resume (optionally rolled back to a checkpoint) and deletion.

An execution *is* a task: ``POST`` mints ``exec_…``, which is the task's name
(``GET /execute/replay?task_id=exec_…`` streams it), and starts its one turn
with ``input`` as the first message — through ``turns.start_turn``, which
also writes the execution's row in its transaction. The loop-worker keeps
the row's status in step with the turn (``loop-worker executions.py``): it
parks the turn on a pause request at the next step boundary, takes the
automatic checkpoints, enforces ``max_duration_seconds`` and runs retries.

What a route here does itself: a pause request (``Keys.pause``); a resume
(rolls back first when asked — ``holdfast_shared.executions.rollback`` —
then queues the turn's resume job); a manual checkpoint (the turn's latest
snapshot, the current conversation's last message, the working memory and a
workspace archive); a delete (a running turn is cancelled as
``POST /execute/cancel`` does, and awaited, before the task is deleted as
``DELETE /tasks/{task_id}`` does).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Query, Response
from holdfast_shared.db.models import Execution, Task, Turn
from holdfast_shared.errors import ErrorCode
from holdfast_shared.executions import (
    CheckpointOut,
    CreateExecution,
    ExecutionOut,
    ExecutionPage,
    ResumeExecution,
    RollbackTarget,
    SaveCheckpoint,
    Status,
    roll_back,
    store,
)
from holdfast_shared.ids import ID_PATTERN, new_id
from holdfast_shared.jobs import TurnJob
from holdfast_shared.turnqueue import queue_turn
from holdfast_shared.working_memory import live_working_memory, stored_working_memory
from holdfast_shared.workspace_checkpoints.requests import (
    WorkspaceRequestError,
    checkpoint_workspace,
)
from sqlalchemy import and_, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway import errors, subagentpauses
from holdfast_gateway.cancelling import request_cancel
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep, require_agent
from holdfast_gateway.errors import ApiError
from holdfast_gateway.outputschema import checked
from holdfast_gateway.routes import tasks
from holdfast_gateway.state import GatewayState
from holdfast_gateway.tasks import TaskRef
from holdfast_gateway.turns import start_turn
from holdfast_gateway.webhooks import accepted

router = APIRouter(prefix="/v1/execution", tags=["executions"])

ExecutionId = Annotated[str, Path(pattern=ID_PATTERN, description="the execution's id (exec_…)")]
# How long DELETE waits for a cancelled turn to end before answering 409: under
# the 10 s many HTTP clients wait for an answer, so they get the 409.
_DELETE_WAIT_SECONDS = 8.0
# How long a tool-runner may take to archive or restore the workspace.
_WORKSPACE_TIMEOUT_SECONDS = 30.0


def _not_found(execution_id: str) -> ApiError:
    return ApiError(
        404,
        ErrorCode.EXECUTION_NOT_FOUND,
        f"execution {execution_id!r} not found",
        {"execution_id": execution_id},
    )


async def _require(state: GatewayState, tenant: str, execution_id: str) -> Execution:
    async with state.sessions() as session:
        row = await store.find(session, tenant, execution_id)
    if row is None:
        raise _not_found(execution_id)
    return row


async def _wire(state: GatewayState, row: Execution) -> ExecutionOut:
    async with state.sessions() as session:
        checkpoints = await store.checkpoints_of(session, [row.id])
        results = await store.results_of(session, [row])
    return store.to_wire(row, checkpoints[row.id], datetime.now(UTC), results.get(row.id))


async def _reread(state: GatewayState, execution_id: str) -> ExecutionOut:
    async with state.sessions() as session:
        row = await session.get(Execution, execution_id)
        if row is None:
            raise _not_found(execution_id)
        checkpoints = await store.checkpoints_of(session, [row.id])
        results = await store.results_of(session, [row])
    return store.to_wire(row, checkpoints[row.id], datetime.now(UTC), results.get(row.id))


# What a client can do next with the execution it created; the fuzzer's stateful
# phase follows these too.
_EXECUTION_LINKS = {
    name: {"operationId": operation, "parameters": {"execution_id": "$response.body#/id"}}
    for name, operation in (
        ("GetExecution", "get_execution"),
        ("SaveCheckpoint", "save_checkpoint"),
        ("PauseExecution", "pause_execution"),
        ("ResumeExecution", "resume_execution"),
        ("DeleteExecution", "delete_execution"),
    )
}


@router.post(
    "",
    status_code=201,
    dependencies=[JsonBody],
    responses={
        201: {"description": "The execution, its work started", "links": _EXECUTION_LINKS},
        **errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404, 507),
    },
    summary="Create an execution and start its work",
)
async def create_execution(
    state: StateDep, tenant: TenantDep, body: Annotated[CreateExecution, Body()]
) -> ExecutionOut:
    # An unknown agent (or another tenant's) is a 404 before anything is written.
    await require_agent(state, tenant, body.agent_id)
    webhook = await accepted(state, tenant, body.webhook, ("body", "webhook"))
    output_schema = checked(body.output_schema)
    execution_id = new_id("exec")
    now = datetime.now(UTC)

    async def write_execution(session: AsyncSession, task: TaskRef, turn_id: str) -> None:
        session.add(
            Execution(
                id=execution_id,
                tenant_id=tenant,
                task_id=task.id,
                turn_id=turn_id,
                name=body.name,
                description=body.description,
                agent_id=body.agent_id,
                task_type=body.task_type,
                status="running",
                state=body.state,
                config=body.config.model_dump(mode="json"),
                running_since=now,
                started_at=now,
                updated_at=now,
            )
        )
        await session.flush()

    await start_turn(
        state,
        tenant,
        message=body.input,
        task_id=execution_id,
        agent=body.agent_id,
        model=None,
        media=[],
        also=write_execution,
        webhook=webhook,
        output_schema=output_schema,
    )
    return await _reread(state, execution_id)


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        started, execution_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        moment = datetime.fromisoformat(started)
        if moment.tzinfo is None or not isinstance(execution_id, str):
            raise ValueError("not one of ours")
        return moment, execution_id
    except (ValueError, TypeError, binascii.Error):
        raise ApiError(
            422,
            ErrorCode.INVALID_REQUEST,
            "cursor: not a cursor this API returned",
            # unknown_cursor: a well-formed string this list never handed out
            # (tests/fuzz_checks.py), as GET /tasks says it.
            {
                "errors": [
                    {"loc": ["query", "cursor"], "msg": "invalid cursor", "type": "unknown_cursor"}
                ]
            },
        ) from None


def _encode_cursor(row: Execution) -> str:
    raw = json.dumps([row.started_at.isoformat(), row.id]).encode()
    return base64.urlsafe_b64encode(raw).decode()


@router.get(
    "",
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="List the tenant's executions, newest first",
)
async def list_executions(
    state: StateDep,
    tenant: TenantDep,
    status: Annotated[Status | None, Query(description="only executions in this status")] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[
        str | None, Query(max_length=400, description="next_cursor of a page")
    ] = None,
    offset: Annotated[
        int | None,
        Query(ge=0, le=100_000, description="skip this many (after the cursor's page, if any)"),
    ] = None,
) -> ExecutionPage:
    query = select(Execution).where(Execution.tenant_id == tenant)
    if status is not None:
        query = query.where(Execution.status == status)
    if cursor is not None:
        started, after_id = _decode_cursor(cursor)
        query = query.where(
            or_(
                Execution.started_at < started,
                and_(Execution.started_at == started, Execution.id < after_id),
            )
        )
    query = query.order_by(Execution.started_at.desc(), Execution.id.desc()).limit(limit + 1)
    if offset is not None:
        query = query.offset(offset)
    async with state.sessions() as session:
        rows = list(await session.scalars(query))
        more = len(rows) > limit
        rows = rows[:limit]
        checkpoints = await store.checkpoints_of(session, [r.id for r in rows])
        results = await store.results_of(session, rows)
    now = datetime.now(UTC)
    return ExecutionPage(
        executions=[store.to_wire(r, checkpoints[r.id], now, results.get(r.id)) for r in rows],
        next_cursor=_encode_cursor(rows[-1]) if more and rows else None,
    )


@router.get(
    "/{execution_id}",
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="Get an execution",
)
async def get_execution(
    state: StateDep, tenant: TenantDep, execution_id: ExecutionId
) -> ExecutionOut:
    return await _wire(state, await _require(state, tenant, execution_id))


@router.put(
    "/{execution_id}/checkpoint",
    status_code=201,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404, 503),
    summary="Save a checkpoint",
)
async def save_checkpoint(
    state: StateDep,
    tenant: TenantDep,
    execution_id: ExecutionId,
    body: Annotated[SaveCheckpoint, Body()],
) -> CheckpointOut:
    row = await _require(state, tenant, execution_id)
    try:
        archive_id = await checkpoint_workspace(
            state.redis,
            state.keys,
            tenant_id=tenant,
            task_id=row.task_id,
            timeout=_WORKSPACE_TIMEOUT_SECONDS,
        )
    except WorkspaceRequestError as exc:
        # A checkpoint whose files are missing would empty them on rollback.
        raise ApiError(
            503, ErrorCode.UNAVAILABLE, f"the workspace was not archived: {exc}"
        ) from None
    async with state.sessions.begin() as session:
        # Locked: two checkpoints with a state each apply in one order.
        locked = await session.scalar(
            select(Execution).where(Execution.id == row.id).with_for_update()
        )
        if locked is None:
            raise _not_found(execution_id)
        snapshot, last_message = await store.turn_position(session, row.task_id, locked.turn_id)
        memory: dict[str, Any] | None = None
        if snapshot is not None:
            memory = snapshot.get("working_memory")
        if memory is None:
            memory = await live_working_memory(state.redis, state.keys, row.task_id)
        if memory is None:
            stored = await session.scalar(select(Task.working_memory).where(Task.id == row.task_id))
            memory = stored_working_memory(stored)
        new_state = body.state if body.state is not None else locked.state
        if body.state is not None:
            locked.state = body.state
        checkpoint = await store.add_checkpoint(
            session,
            locked,
            label=body.label,
            state=new_state,
            turn_state=snapshot,
            last_message_id=last_message,
            working_memory=memory,
            workspace_archive_id=archive_id,
            automatic=False,
        )
        out = store.checkpoint_out(checkpoint)
    return out


@router.post(
    "/{execution_id}/pause",
    status_code=202,
    responses=errors.responses(*errors.AUTHENTICATED, 404, 409),
    summary="Pause a running execution at its next step boundary",
)
async def pause_execution(
    state: StateDep, tenant: TenantDep, execution_id: ExecutionId
) -> ExecutionOut:
    row = await _require(state, tenant, execution_id)
    if row.status != "running" or row.turn_id is None:
        raise ApiError(
            409,
            ErrorCode.EXECUTION_NOT_RUNNING,
            f"execution {execution_id!r} is {row.status}, not running",
            {"execution_id": execution_id, "status": row.status},
        )
    # The worker running the turn cuts a streaming model call short (else the
    # flag parks it at its next step boundary, whoever runs it then).
    await subagentpauses.request_pause(state, row.task_id, row.turn_id)
    # Its subagents' turns pause too (a parent waiting for them is cut short).
    await subagentpauses.pause(state, row.task_id)
    async with state.sessions.begin() as session:
        turn_status = await session.scalar(select(Turn.status).where(Turn.id == row.turn_id))
        if turn_status == "parked":
            # Waiting for a human: no worker holds it and none will reach a
            # boundary until the answer comes (it then parks for the pause).
            await store.mark_paused(session, row.task_id, store.elapsed_ms(row, datetime.now(UTC)))
    return await _reread(state, execution_id)


@router.post(
    "/{execution_id}/resume",
    responses=errors.responses(*errors.AUTHENTICATED, 404, 409, 413),
    summary="Resume a paused execution, optionally rolled back to a checkpoint",
)
async def resume_execution(
    state: StateDep,
    tenant: TenantDep,
    execution_id: ExecutionId,
    body: Annotated[ResumeExecution | None, Body()] = None,
) -> ExecutionOut:
    row = await _require(state, tenant, execution_id)
    if row.status != "paused" or row.turn_id is None:
        raise ApiError(
            409,
            ErrorCode.EXECUTION_NOT_PAUSED,
            f"execution {execution_id!r} is {row.status}, not paused",
            {"execution_id": execution_id, "status": row.status},
        )
    turn_id = row.turn_id
    checkpoint = None
    if body is not None and body.checkpoint_id is not None:
        async with state.sessions() as session:
            found = await store.checkpoints_of(session, [row.id])
        checkpoint = next((c for c in found[row.id] if c.id == body.checkpoint_id), None)
        if checkpoint is None:
            raise ApiError(
                404,
                ErrorCode.CHECKPOINT_NOT_FOUND,
                f"execution {execution_id!r} has no checkpoint {body.checkpoint_id!r}",
                {"execution_id": execution_id, "checkpoint_id": body.checkpoint_id},
            )
    # Claim the resume: of two racing ones, one goes on, the other is a 409.
    async with state.sessions.begin() as session:
        if not await store.mark_running(session, row.id, from_status="paused"):
            raise ApiError(
                409,
                ErrorCode.EXECUTION_NOT_PAUSED,
                f"execution {execution_id!r} is no longer paused",
                {"execution_id": execution_id},
            )
        # Withdrawn while the update holds the execution's row: a worker parking
        # the turn reads the request under that lock (store.lock_for_pause), so
        # it either parked before this resume or finds the pause gone.
        await state.redis.delete(state.keys.pause(row.task_id))
    try:
        if checkpoint is not None:
            await roll_back(
                sessions=state.sessions,
                redis=state.redis,
                keys=state.keys,
                eventlog=state.eventlog,
                execution=row,
                task_name=row.id,
                target=RollbackTarget(checkpoint),
                snapshot_ttl=_snapshot_ttl(state),
                workspace_timeout=_WORKSPACE_TIMEOUT_SECONDS,
            )
        async with state.sessions.begin() as session:
            # Claimable again (and requeued by recovery should the job be lost).
            await store.claimable_again(session, turn_id, from_statuses=("paused", "parked"))
        await state.lock.extend(row.task_id, turn_id, state.settings.turn_deadline_seconds + 600)
    except BaseException as exc:
        # Still paused: nothing the client asked for happened (the rollback
        # changes nothing until its transaction).
        async with state.sessions.begin() as session:
            await session.execute(
                update(Execution)
                .where(Execution.id == row.id)
                .values(status="paused", paused_at=row.paused_at, running_since=None)
            )
        if isinstance(exc, WorkspaceRequestError):
            raise ApiError(
                503, ErrorCode.UNAVAILABLE, f"the workspace could not be restored: {exc}"
            ) from None
        raise
    await queue_turn(state.redis, state.keys, TurnJob.resuming(tenant, row.task_id, turn_id))
    # Its subagents go on too: the resumed turn's delegate calls find them.
    await subagentpauses.resume(state, tenant, row.task_id)
    return await _reread(state, execution_id)


def _snapshot_ttl(state: GatewayState) -> timedelta:
    return timedelta(seconds=state.settings.channel_state_ttl_active)


@router.delete(
    "/{execution_id}",
    status_code=204,
    responses=errors.responses(*errors.AUTHENTICATED, 404, 409),
    summary="Delete an execution (a running one is terminated first)",
)
async def delete_execution(
    state: StateDep, tenant: TenantDep, execution_id: ExecutionId
) -> Response:
    row = await _require(state, tenant, execution_id)
    await _terminate(state, tenant, row)
    await tasks.delete_task(state, tenant, row.id)
    return Response(status_code=204)


async def _terminate(state: GatewayState, tenant: str, row: Execution) -> None:
    """End the execution's turn if it still holds the task; back once it ended.

    Checked again on every round, since a pause racing the delete can park the
    turn while the delete waits: a paused turn is no worker's, so its cancel
    would never be taken, and the delete ends it itself.
    """
    signalled: str | None = None
    loop = asyncio.get_running_loop()
    until = loop.time() + _DELETE_WAIT_SECONDS
    while (holder := await state.lock.holder(row.task_id)) is not None:
        if await _end_if_paused(state, row, holder):
            continue
        if signalled != holder:
            await request_cancel(state, tenant, row.task_id, holder)
            signalled = holder
        if loop.time() > until:
            raise ApiError(
                409,
                ErrorCode.TURN_IN_PROGRESS,
                f"execution {row.id!r} is still stopping; try the delete again",
                {"execution_id": row.id},
            )
        await asyncio.sleep(0.05)


async def _end_if_paused(state: GatewayState, row: Execution, holder: str) -> bool:
    """Cancel ``holder`` here if it is paused (no worker holds a paused turn)."""
    async with state.sessions.begin() as session:
        ended = await session.execute(
            update(Turn)
            .where(Turn.id == holder, Turn.status == "paused")
            .values(status="cancelled", stop_reason="cancelled", finished_at=datetime.now(UTC))
        )
        if not ended.rowcount:  # type: ignore[attr-defined]
            return False
        await store.mark_ended(session, row.task_id, "terminated", turn_active_ms=None)
    await state.lock.release(row.task_id, holder)
    return True
