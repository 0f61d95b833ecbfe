"""``POST /execute``: start a turn and stream its events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body
from holdfast_shared.availability import available_providers
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.modelspec import parse_model_spec
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sse_starlette import EventSourceResponse

from holdfast_gateway.deps import StateDep, TenantDep
from holdfast_gateway.errors import ApiError
from holdfast_gateway.sse import event_frames, frame, sse_response
from holdfast_gateway.turns import start_turn

router = APIRouter()

MAX_MESSAGE_CHARS = 1_000_000


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: Annotated[str, Field(min_length=1, max_length=MAX_MESSAGE_CHARS)]
    task_id: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    agent: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    model: Annotated[str | None, Field(max_length=200)] = None
    media: list[dict[str, Any]] = []
    direct: bool = False

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str | None) -> str | None:
        if value is not None:
            parse_model_spec(value)  # raises ValueError → 422 naming the provider
        return value


@router.post(
    "/execute",
    response_class=EventSourceResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
    summary="Send a message to a task and stream the turn as Server-Sent Events",
)
async def execute(
    state: StateDep, tenant: TenantDep, request: Annotated[ExecuteRequest, Body()]
) -> EventSourceResponse:
    if request.model is not None:
        await _require_provider(state, request.model)
    turn = await start_turn(
        state,
        tenant,
        message=request.message,
        task_id=request.task_id,
        agent=request.agent,
        model=request.model,
        media=request.media,
        direct=request.direct,
    )

    async def frames() -> AsyncIterator[str]:
        yield frame(turn.started)
        async for chunk in event_frames(
            state.hub, state.eventlog, turn.task_id, turn.started.seq, stop_turn=turn.turn_id
        ):
            yield chunk

    return sse_response(
        frames(),
        turn.task_id,
        state.settings.heartbeat_seconds,
        headers={"X-Task-Id": turn.task_id, "X-Turn-Id": turn.turn_id},
    )


async def _require_provider(state: StateDep, model: str) -> None:
    provider = parse_model_spec(model).provider
    if provider not in await available_providers(state.redis, state.keys):
        raise ApiError(
            422,
            ErrorCode.MODEL_UNAVAILABLE,
            f"no running loop-worker can serve provider {provider!r}: "
            "set its API key in the loop-workers' environment",
            {"model": model},
        )
