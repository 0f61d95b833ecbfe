"""``GET /execute/replay``: a task's events after a cursor, then live to the turn's end."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from holdfast_shared.db.models import Task
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from sse_starlette import EventSourceResponse

from holdfast_gateway.deps import StateDep, TenantDep
from holdfast_gateway.errors import ApiError
from holdfast_gateway.sse import event_frames, sse_response

router = APIRouter()


@router.get(
    "/execute/replay",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
    summary="Replay a task's events after a cursor, then follow the running turn",
)
async def replay(
    state: StateDep,
    tenant: TenantDep,
    task_id: Annotated[str, Query(pattern=ID_PATTERN)],
    after: Annotated[int | None, Query(ge=0, description="timestamp cursor, epoch ms")] = None,
    after_seq: Annotated[int | None, Query(ge=0, description="seq cursor")] = None,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventSourceResponse:
    async with state.sessions() as session:
        owner = await session.scalar(
            Task.__table__.select().with_only_columns(Task.tenant_id).where(Task.id == task_id)
        )
    if owner != tenant:
        raise ApiError(404, ErrorCode.TASK_NOT_FOUND, f"task {task_id!r} not found")

    cursor = await _cursor(state, task_id, after, after_seq, last_event_id)
    running = await state.lock.holder(task_id)
    frames = event_frames(state.hub, state.eventlog, task_id, cursor, stop_turn=running)
    return sse_response(frames, task_id, state.settings.heartbeat_seconds)


async def _cursor(
    state: StateDep,
    task_id: str,
    after: int | None,
    after_seq: int | None,
    last_event_id: str | None,
) -> int:
    """A seq cursor from whichever one the client gave (seq-based ones win)."""
    if last_event_id is not None:
        if not last_event_id.isdigit():
            raise ApiError(
                422, ErrorCode.INVALID_REQUEST, "Last-Event-ID must be an event seq (an integer)"
            )
        return int(last_event_id)
    if after_seq is not None:
        return after_seq
    if after:
        return await state.eventlog.seq_at_timestamp(task_id, after)
    return 0
