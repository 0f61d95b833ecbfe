"""``GET /execute/replay``: a task's events after a cursor, then live to the turn's end.

Authenticated by ``X-Engine-Key``, or by a stream token (``?token=``, from
``POST /auth/stream-token``) for clients that cannot set headers: a browser's
``EventSource``, whose reconnects resend the same URL with ``Last-Event-ID``.

``follow=task`` keeps the stream open past the turn's end (or when no turn
runs), with heartbeats, for every later turn: a view of the task (the web
console) holds one connection instead of reopening a stream that ends at once
whenever the task is idle. It lasts at most the stream token TTL and then
ends, so a revoked key or a deleted task stops being followed within that
time; by then the token it was opened with has expired too, and the client
asks for a new one and goes on from its cursor.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request, Security
from holdfast_shared.ids import ID_PATTERN

from holdfast_gateway import errors
from holdfast_gateway.deps import StateDep, engine_key
from holdfast_gateway.openapi import SSE_CONTENT
from holdfast_gateway.routes.auth import replay_task
from holdfast_gateway.sse import SseResponse, event_frames, sse_response
from holdfast_gateway.streamtokens import MAX_TOKEN_CHARS

router = APIRouter(tags=["execute"])

# Every cursor is checked against this range before anything is read or sent
# (Redis stream ids and PostgreSQL bigints both hold it, with room for +1).
MAX_CURSOR = 10**18 - 1


@router.get(
    "/execute/replay",
    response_class=SseResponse,
    responses={
        200: {"description": "the events after the cursor", "content": SSE_CONTENT},
        **errors.responses(*errors.AUTHENTICATED, 403, 404),
    },
    summary="Replay a task's events after a cursor, then follow the running turn",
)
async def replay(
    request: Request,
    state: StateDep,
    task_id: Annotated[str, Query(pattern=ID_PATTERN)],
    after: Annotated[
        int | None, Query(ge=0, le=MAX_CURSOR, description="timestamp cursor, epoch ms")
    ] = None,
    after_seq: Annotated[int | None, Query(ge=0, le=MAX_CURSOR, description="seq cursor")] = None,
    last_event_id: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            pattern=r"^[0-9]{0,18}$",
            description="seq cursor, as an SSE client resends it; empty is the same as absent",
        ),
    ] = None,
    token: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=MAX_TOKEN_CHARS,
            description="a stream token for this task (POST /auth/stream-token), "
            "instead of the X-Engine-Key header",
        ),
    ] = None,
    follow: Annotated[
        Literal["turn", "task"],
        Query(
            description="`turn`: end with the running turn (at once when none runs); "
            "`task`: stay open, with heartbeats, through every later turn, for up to "
            "HOLDFAST_STREAM_TOKEN_TTL_SECONDS, then end (reconnect from your cursor)"
        ),
    ] = "turn",
    x_engine_key: Annotated[str | None, Security(engine_key)] = None,
) -> SseResponse:
    task = await replay_task(request, state, task_id, token=token, key=x_engine_key)
    cursor = await _cursor(state, task.id, after, after_seq, last_event_id)
    running = await state.lock.holder(task.id)
    follow_for = float(state.settings.stream_token_ttl_seconds) if follow == "task" else None
    frames = event_frames(
        state.hub, state.reads, task.id, cursor, stop_turn=running, follow_for=follow_for
    )
    return sse_response(frames, task.name, state.settings.heartbeat_seconds)


async def _cursor(
    state: StateDep,
    task_id: str,
    after: int | None,
    after_seq: int | None,
    last_event_id: str | None,
) -> int:
    """A seq cursor from whichever one the client gave (seq-based ones win)."""
    if last_event_id:
        return int(last_event_id)  # ASCII digits only: the route's pattern saw to it
    if after_seq is not None:
        return after_seq
    if after:
        return await state.eventlog.seq_at_timestamp(task_id, after)
    return 0
