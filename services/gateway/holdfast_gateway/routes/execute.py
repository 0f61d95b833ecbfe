"""``POST /execute``: start a turn and stream its events."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body
from holdfast_shared.agents import AgentDefinition, model_for
from holdfast_shared.availability import available_providers, default_models
from holdfast_shared.content import (
    MAX_MEDIA_ITEMS,
    MediaItem,
    Text,
    as_stored,
    check_media_total,
)
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.media import first_unsupported, unsupported_media
from holdfast_shared.memory.brain import USER_ID_PATTERN
from holdfast_shared.modelspec import MODEL_SPEC_PATTERN, parse_model_spec
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sse_starlette import EventSourceResponse

from holdfast_gateway import errors
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep, require_agent
from holdfast_gateway.errors import ApiError
from holdfast_gateway.openapi import SSE_CONTENT
from holdfast_gateway.sse import event_frames, frame, sse_response
from holdfast_gateway.turns import start_turn

router = APIRouter()

MAX_MESSAGE_CHARS = 1_000_000
_MODEL_SPEC = re.compile(MODEL_SPEC_PATTERN)


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: Annotated[Text, Field(min_length=1, max_length=MAX_MESSAGE_CHARS)]
    task_id: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    agent: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    user_id: Annotated[
        str | None,
        Field(
            pattern=USER_ID_PATTERN,
            description="the end user this message is from: each user of a tenant has a "
            "long-term memory of their own (default: the tenant's shared one)",
        ),
    ] = None
    model: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=200,
                description="provider[:model], e.g. anthropic:claude-sonnet-4-5",
                json_schema_extra={"pattern": MODEL_SPEC_PATTERN},
            ),
        ]
        | None
    ) = None
    media: Annotated[
        list[MediaItem],
        Field(
            max_length=MAX_MEDIA_ITEMS,
            description="images and files for the model, inline (base64) or by URL",
        ),
    ] = []

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str | None) -> str | None:
        if value is not None:
            parse_model_spec(value)  # raises ValueError → 422 naming the provider
            if not _MODEL_SPEC.fullmatch(value):
                raise ValueError("a model is provider[:model], in ASCII without spaces")
        return value

    @field_validator("media")
    @classmethod
    def _bounded_media(cls, value: list[Any]) -> list[Any]:
        check_media_total(value)
        return value


# What a client can do next with the task the response names (X-Task-Id).
_TASK_LINKS = {
    "ReplayTask": {
        "operationId": "replay",
        "parameters": {"task_id": "$response.header.X-Task-Id"},
    },
    "CancelTurn": {
        "operationId": "cancel",
        "requestBody": {"task_id": "$response.header.X-Task-Id"},
    },
    "PendingQuestions": {
        "operationId": "pending",
        "parameters": {"task_id": "$response.header.X-Task-Id"},
    },
    "DeleteTask": {
        "operationId": "delete_task",
        "parameters": {"task_id": "$response.header.X-Task-Id"},
    },
}
_TURN_HEADERS = {
    "X-Task-Id": {"description": "the task's id", "schema": {"type": "string"}, "required": True},
    "X-Turn-Id": {
        "description": "the new turn's id",
        "schema": {"type": "string"},
        "required": True,
    },
}


@router.post(
    "/execute",
    response_class=EventSourceResponse,
    dependencies=[JsonBody],
    responses={
        200: {
            "description": "the turn's events until it ends",
            "content": SSE_CONTENT,
            "headers": _TURN_HEADERS,
            "links": _TASK_LINKS,
        },
        **errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404, 409),
    },
    summary="Send a message to a task and stream the turn as Server-Sent Events",
)
async def execute(
    state: StateDep, tenant: TenantDep, request: Annotated[ExecuteRequest, Body()]
) -> EventSourceResponse:
    # An unknown agent (or another tenant's) is a 404 before anything is written.
    agent = await require_agent(state, tenant, request.agent)
    if request.model is not None:
        await _require_provider(state, request.model)
    if request.media:
        await _require_media_support(state, request, agent)
    turn = await start_turn(
        state,
        tenant,
        message=request.message,
        task_id=request.task_id,
        agent=request.agent,
        model=request.model,
        media=as_stored(request.media),
        user_id=request.user_id or "",
    )

    async def frames() -> AsyncIterator[str]:
        yield frame(turn.started)
        async for chunk in event_frames(
            state.hub, state.eventlog, turn.task.id, turn.started.seq, stop_turn=turn.turn_id
        ):
            yield chunk

    return sse_response(
        frames(),
        turn.task.name,
        state.settings.heartbeat_seconds,
        headers={"X-Task-Id": turn.task.name, "X-Turn-Id": turn.turn_id},
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


async def _require_media_support(
    state: StateDep, request: ExecuteRequest, agent: AgentDefinition
) -> None:
    """422 naming the type when the turn's model cannot take one of the media.

    The turn's model is the one a worker will pick: the request's, else the
    operator's for the agent (``HOLDFAST_AGENT_MODELS``), else the agent's
    preferred one when a worker serves its provider, else the workers'
    default, as they advertise it (every live worker's, should they differ).
    """
    spec = model_for(
        agent,
        requested=request.model,
        overrides=state.settings.agent_models,
        served=await available_providers(state.redis, state.keys),
    )
    if spec:
        specs = {spec}
    else:
        specs = await default_models(state.redis, state.keys)
        if not specs and state.settings.model:
            specs = {state.settings.model}
    items = as_stored(request.media)
    for candidate in sorted(specs):
        try:
            parsed = parse_model_spec(candidate)
        except ValueError:
            continue  # not this check's to report: the turn fails with UNKNOWN_MODEL
        reason = unsupported_media(parsed.provider, parsed.model, items)
        index = first_unsupported(parsed.provider, parsed.model, items)
        if reason is not None and index is not None:
            details = {"model": str(parsed), "media_type": items[index]["media_type"]}
            raise ApiError(422, ErrorCode.UNSUPPORTED_MEDIA, reason, {**details, "index": index})
