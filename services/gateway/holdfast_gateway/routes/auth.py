"""``POST /auth/stream-token``, and how ``GET /execute/replay`` checks the token.

See :mod:`holdfast_gateway.streamtokens` for what a token is and why.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Request
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from pydantic import BaseModel, ConfigDict, Field

from holdfast_gateway import errors
from holdfast_gateway.deps import CallerDep, JsonBody, StateDep, authenticate, require_task
from holdfast_gateway.errors import ApiError
from holdfast_gateway.state import GatewayState
from holdfast_gateway.streamtokens import StreamTokens
from holdfast_gateway.tasks import TaskRef

router = APIRouter(tags=["auth"])


class StreamTokenRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: Annotated[str, Field(pattern=ID_PATTERN, description="the task to replay")]


class StreamToken(BaseModel):
    token: str
    task_id: str
    expires_at: Annotated[int, Field(description="epoch ms")]


def _tokens(state: GatewayState) -> StreamTokens:
    assert state.stream_tokens is not None, "the lifespan sets the signer up"
    return state.stream_tokens


@router.post(
    "/auth/stream-token",
    response_model=StreamToken,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404),
    summary="A short-lived token that opens one task's replay (?token=) without the API key",
)
async def stream_token(
    state: StateDep, caller: CallerDep, body: Annotated[StreamTokenRequest, Body()]
) -> StreamToken:
    task = await require_task(state, caller.tenant, body.task_id)
    tokens = _tokens(state)
    grant = tokens.issue(caller.tenant, task.id, task.name, caller.key_id)
    return StreamToken(
        token=tokens.encode(grant), task_id=task.name, expires_at=grant.expires_at * 1000
    )


async def replay_task(
    request: Request,
    state: GatewayState,
    task_id: str,
    *,
    token: str | None,
    key: str | None,
) -> TaskRef:
    """The task a replay may read: by the stream ``token`` when given, else by
    the API ``key`` (``X-Engine-Key``) — 401/403/404 with a JSON code otherwise."""
    if token is None:
        if not key:
            raise ApiError(401, ErrorCode.INVALID_KEY, "missing X-Engine-Key header (or a ?token=)")
        caller = await authenticate(request, state, key)
        return await require_task(state, caller.tenant, task_id)
    grant = _tokens(state).decode(token)
    if grant.task_name != task_id:
        raise _wrong_task(task_id)
    if not await state.auth.key_active(grant.key_id):
        raise ApiError(
            401, ErrorCode.INVALID_KEY, "the API key this stream token was issued to is revoked"
        )
    task = await require_task(state, grant.tenant, task_id)
    if task.id != grant.task_id:
        # The task was deleted and its name taken again since the token was made.
        raise _wrong_task(task_id)
    return task


def _wrong_task(task_id: str) -> ApiError:
    return ApiError(
        403,
        ErrorCode.STREAM_TOKEN_WRONG_TASK,
        f"the stream token was not issued for task {task_id!r}",
        {"task_id": task_id},
    )
