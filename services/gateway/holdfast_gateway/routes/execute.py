"""``POST /execute``: start a turn and stream its events."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header
from holdfast_shared.agents import AgentDefinition, model_for
from holdfast_shared.content import (
    MAX_MEDIA_ITEMS,
    MediaItem,
    StorableObject,
    Text,
    as_stored,
    check_media_total,
)
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.liveness import available_providers, default_models, unavailable_models
from holdfast_shared.media_support import first_unsupported, unsupported_media
from holdfast_shared.memory.brain import USER_ID_PATTERN
from holdfast_shared.modelspec import MODEL_SPEC_PATTERN, parse_model_spec
from holdfast_shared.turnqueue import BusyMode
from holdfast_shared.webhooks import WebhookSpec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from holdfast_gateway import busy, errors, executekeys
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep, require_agent
from holdfast_gateway.errors import ApiError
from holdfast_gateway.forks import ForkRequest, invalid_field
from holdfast_gateway.openapi import SSE_CONTENT
from holdfast_gateway.outputschema import DESCRIPTION, checked
from holdfast_gateway.sse import SseResponse, event_frames, frame, sse_response
from holdfast_gateway.turns import start_turn
from holdfast_gateway.webhooks import accepted

router = APIRouter(tags=["execute"])

MAX_MESSAGE_CHARS = 1_000_000
# Message ids are PostgreSQL bigints.
MAX_MESSAGE_ID = 2**63 - 1
_MODEL_SPEC = re.compile(MODEL_SPEC_PATTERN)


def _present(*names: str) -> dict[str, Any]:
    return {"required": list(names)}


# What _fork_request (and on_busy) check across fields, as JSON Schema: a
# client (or a fuzzer) reading the description knows which bodies are valid.
# ``message`` and the message ids are never null, so "present" is "given".
_FORK_RULES: dict[str, Any] = {
    "allOf": [
        {"anyOf": [_present("message"), _present("retry_message_id")]},
        {"not": _present("edit_message_id", "retry_message_id")},
        {
            "if": {"anyOf": [_present("edit_message_id"), _present("retry_message_id")]},
            "then": {
                **_present("task_id"),
                "properties": {"task_id": {"type": "string"}, "on_busy": {"const": "reject"}},
            },
        },
        # A queued message takes no output_schema (see execute()).
        {"if": _present("output_schema"), "then": {"properties": {"on_busy": {"const": "reject"}}}},
        {
            "if": _present("retry_message_id"),
            "then": {
                "not": _present("message"),
                "properties": {"media": {"type": "array", "maxItems": 0}},
            },
        },
    ]
}


def _fork_rules(schema: dict[str, Any]) -> None:
    # Absent (None) but never null on the wire: the description says so.
    for name in ("message", "edit_message_id", "retry_message_id"):
        field = schema["properties"][name]
        given = [s for s in field.pop("anyOf", ()) if s.get("type") != "null"]
        field.update(given[0] if given else {})
        field.pop("default", None)
    schema.update(_FORK_RULES)


class ExecuteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_fork_rules)

    # Required but with retry_message_id (checked by _fork_request).
    message: Annotated[Text, Field(min_length=1, max_length=MAX_MESSAGE_CHARS)] | None = None
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

    edit_message_id: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_MESSAGE_ID,
            description="edit: an earlier user message of the task (an id from GET "
            "/tasks/{task_id}/messages); it and everything after it leave the conversation's "
            "current branch and `message` runs in its place. Needs `task_id`",
        ),
    ] = None
    retry_message_id: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_MESSAGE_ID,
            description="retry: a user message of the task to answer again; everything "
            "after it leaves the current branch and a new turn opens with the same "
            "message. Needs `task_id`; takes no `message` or `media`",
        ),
    ] = None

    webhook: WebhookSpec | None = Field(
        default=None,
        description="POST the turn's end and questions there, signed (README, Completion "
        "webhooks); default: the tenant's (PUT /webhooks/default)",
    )

    output_schema: StorableObject | None = Field(default=None, description=DESCRIPTION)

    on_busy: BusyMode = Field(
        default="reject",
        description="when the task's turn is still running: `reject` (409), `enqueue` (run "
        "after it), `interrupt` (cancel it, then run) or `steer` (join it at its next "
        "step); see README, Double-texting",
    )

    @field_validator("message", "edit_message_id", "retry_message_id", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        # Absent is None; an explicit null is not a value the description allows.
        if value is None:
            raise ValueError("leave the field out instead of sending null")
        return value

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


def _task_link(operation: str, where: str = "parameters") -> dict[str, Any]:
    """An OpenAPI link: ``operation`` with the response's X-Task-Id as its ``task_id``."""
    return {"operationId": operation, where: {"task_id": "$response.header.X-Task-Id"}}


# What a client can do next with the task the response names (X-Task-Id).
_TASK_LINKS = {
    "ReplayTask": _task_link("replay"),
    "CancelTurn": _task_link("cancel", "requestBody"),
    "PendingQuestions": _task_link("pending"),
    "DeleteTask": _task_link("delete_task"),
}
_TURN_HEADERS = {
    "X-Task-Id": {"description": "the task's id", "schema": {"type": "string"}, "required": True},
    "X-Turn-Id": {
        "description": "the new turn's id (with `on_busy`: the message's, which a steer's "
        "`user_message` event names as `message_id`)",
        "schema": {"type": "string"},
        "required": True,
    },
    "X-Queued": {
        "description": "with an `on_busy` other than `reject`: the mode the message waited "
        "by (`enqueue`, `interrupt`, `steer`), or `no` when it started at once",
        "schema": {"type": "string", "enum": ["no", "enqueue", "interrupt", "steer"]},
    },
}


def _options(
    request: ExecuteRequest,
    webhook: dict[str, Any] | None,
    claim: executekeys.Recorder | None,
) -> busy.TurnOptions:
    return busy.TurnOptions(
        task_id=request.task_id,
        agent=request.agent,
        model=request.model,
        media=as_stored(request.media),
        user_id=request.user_id or "",
        webhook=webhook,
        claim=claim,
    )


IdempotencyKey = Annotated[
    str | None,
    Header(
        alias=executekeys.HEADER,
        pattern=executekeys.PATTERN,
        description="one per message (a UUID does): a request sent again with it, its "
        "response lost, streams the turn the first one started (`Idempotent-Replayed: "
        "true`) instead of running the message twice; with another request it is 422 "
        "`IDEMPOTENCY_KEY_REUSED`. See README, Sending a message again",
    ),
]


@router.post(
    "/execute",
    response_class=SseResponse,
    dependencies=[JsonBody],
    responses={
        200: {
            "description": "the turn's events until it ends",
            "content": SSE_CONTENT,
            "headers": _TURN_HEADERS,
            "links": _TASK_LINKS,
        },
        **errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404, 409, 507),
    },
    summary="Send a message to a task and stream the turn as Server-Sent Events",
)
async def execute(
    state: StateDep,
    tenant: TenantDep,
    request: Annotated[ExecuteRequest, Body()],
    idempotency_key: IdempotencyKey = None,
) -> SseResponse:
    if idempotency_key is None:
        return await _execute(state, tenant, request, None)
    printed = executekeys.fingerprint(request)
    if (turn := await executekeys.earlier(state, tenant, idempotency_key, printed)) is not None:
        return executekeys.replay(state, turn)
    claim = executekeys.recorder(state, tenant, idempotency_key, printed)
    try:
        return await _execute(state, tenant, request, claim)
    except executekeys.KeyTaken:
        # A request with the key committed first (the two raced): follow its turn.
        turn = await executekeys.earlier(state, tenant, idempotency_key, printed)
        if turn is None:  # its turn is gone already (taken back, its task deleted)
            raise
        return executekeys.replay(state, turn)


async def _execute(
    state: StateDep,
    tenant: str,
    request: ExecuteRequest,
    claim: executekeys.Recorder | None,
) -> SseResponse:
    fork = _fork_request(request)
    # An unknown agent (or another tenant's) is a 404 before anything is written.
    agent = await require_agent(state, tenant, request.agent)
    if request.model is not None:
        await _require_provider(state, request.model)
    await _require_available(state, request, agent)
    if request.media:
        await _require_media_support(state, request, agent)
    webhook = await accepted(state, tenant, request.webhook, ("body", "webhook"))
    output_schema = checked(request.output_schema)
    if request.on_busy != "reject":
        if fork is not None or request.message is None:
            raise invalid_field("on_busy", 'an edit or a retry takes on_busy "reject" only')
        if output_schema is not None:
            raise invalid_field("on_busy", 'a turn with an output_schema takes on_busy "reject"')
        return await busy.respond(
            state, tenant, request.on_busy, request.message, **_options(request, webhook, claim)
        )
    turn = await start_turn(
        state,
        tenant,
        message=request.message,
        fork=fork,
        output_schema=output_schema,
        **_options(request, webhook, claim),
    )

    async def frames() -> AsyncIterator[str]:
        yield frame(turn.started)
        async for chunk in event_frames(
            state.hub, state.reads, turn.task.id, turn.started.seq, stop_turn=turn.turn_id
        ):
            yield chunk

    return sse_response(
        frames(),
        turn.task.name,
        state.settings.heartbeat_seconds,
        headers={"X-Task-Id": turn.task.name, "X-Turn-Id": turn.turn_id},
    )


def _fork_request(request: ExecuteRequest) -> ForkRequest | None:
    """The edit or retry the request asks for; 422 naming the field when the
    fields do not go together (the message itself is checked by start_turn)."""
    if request.edit_message_id is not None and request.retry_message_id is not None:
        raise invalid_field(
            "retry_message_id", "give edit_message_id or retry_message_id, not both"
        )
    if request.retry_message_id is not None:
        if request.message is not None:
            raise invalid_field(
                "message", "a retry answers the message again: send no message (or edit it)"
            )
        if request.media:
            raise invalid_field("media", "a retry answers the message again: send no media")
        fork = ForkRequest("retry_message_id", request.retry_message_id)
    elif request.message is None:
        raise invalid_field("message", "Field required", "missing")
    elif request.edit_message_id is not None:
        fork = ForkRequest("edit_message_id", request.edit_message_id)
    else:
        return None
    if request.task_id is None:
        raise invalid_field("task_id", f"{fork.field} needs the task_id of its task")
    return fork


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


async def _turn_models(
    state: StateDep, request: ExecuteRequest, agent: AgentDefinition
) -> set[str]:
    """The model the turn will run: the one a worker will pick.

    The request's, else the operator's for the agent (``HOLDFAST_AGENT_MODELS``),
    else the agent's preferred one when a worker serves its provider, else the
    workers' default, as they advertise it (every live worker's, should they differ).
    """
    spec = model_for(
        agent,
        requested=request.model,
        overrides=state.settings.agent_models,
        served=await available_providers(state.redis, state.keys),
    )
    if spec:
        return {spec}
    specs = await default_models(state.redis, state.keys)
    if not specs and state.settings.model:
        specs = {state.settings.model}
    return specs


async def _require_available(
    state: StateDep, request: ExecuteRequest, agent: AgentDefinition
) -> None:
    """422 ``MODEL_UNAVAILABLE`` when a worker said the turn's model cannot run
    there (its context window is too small: ``liveness.unavailable_models``)."""
    unavailable = await unavailable_models(state.redis, state.keys)
    if not unavailable:
        return
    for candidate in sorted(await _turn_models(state, request, agent)):
        try:
            spelled = str(parse_model_spec(candidate))
        except ValueError:
            continue
        why = unavailable.get(spelled)
        if why is not None:
            raise ApiError(422, ErrorCode.MODEL_UNAVAILABLE, why, {"model": spelled})


async def _require_media_support(
    state: StateDep, request: ExecuteRequest, agent: AgentDefinition
) -> None:
    """422 naming the type when the turn's model (:func:`_turn_models`) cannot
    take one of the media."""
    specs = await _turn_models(state, request, agent)
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
