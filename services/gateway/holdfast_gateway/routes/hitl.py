"""Human-in-the-loop: ``GET /hitl/pending`` and ``POST /hitl/respond``.

An answer is recorded first (a conditional update, so two answers cannot
both win), then a resume job is queued: the waiting turn holds no worker, so
whichever worker takes the job continues it, emits ``hitl_resolved`` and
goes on — also days later and after every process restarted.

The answer a request takes depends on its ``kind`` (422 ``INVALID_REQUEST``
otherwise): ``permission`` — ``yes`` or ``no``; ``question`` — any text;
``outcome_unknown`` (an effectful tool call whose outcome nobody knows) —
``retry`` (run it again with the same idempotency key), ``succeeded`` (the
``feedback``, if given, is the result the model sees) or ``failed``;
``elicitation`` (an MCP server's question during a tool call) — ``accept`` with
``content`` valid against the request's ``requested_schema`` (its
``tool_call.requested_schema``), ``decline`` or ``cancel``. An elicitation's
turn is not parked (its call is live): the answer wakes it instead of queuing a
resume.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query
from holdfast_shared.content import (
    MAX_MEDIA_ITEMS,
    ContentBlock,
    Text,
    as_stored,
    check_media_total,
)
from holdfast_shared.db.models import HitlRequestRecord, Task
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.jobs import TurnJob, elicitation_answered_key
from holdfast_shared.turnqueue import queue_turn
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select, update

from holdfast_gateway import errors
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep
from holdfast_gateway.errors import ApiError
from holdfast_gateway.tasks import find_task, with_subagents

router = APIRouter(tags=["hitl"])

# The answers a kind of request takes (a question's: any text).
_ANSWERS: dict[str, tuple[str, ...]] = {
    "permission": ("yes", "no"),
    "outcome_unknown": ("retry", "succeeded", "failed"),
    "elicitation": ("accept", "decline", "cancel"),
}
# How long the gateway's wake-up for an elicitation's turn stays, unread.
_WAKE_TTL_SECONDS = 600


class HitlAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: Annotated[str, Field(pattern=ID_PATTERN)]
    request_id: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    answer: Annotated[
        Text,
        Field(
            min_length=1,
            max_length=100_000,
            description="by the request's kind: permission — yes or no; question — any "
            "text; outcome_unknown — retry, succeeded or failed; elicitation — accept, "
            "decline or cancel",
        ),
    ]
    feedback: (
        Annotated[
            Text,
            Field(
                max_length=100_000,
                description="shown to the model with the answer; for outcome_unknown answered "
                "succeeded, the tool's result",
            ),
        ]
        | None
    ) = None
    content: (
        Annotated[
            dict[str, Any],
            Field(
                max_length=100,
                description="elicitation answered accept: the form's values, valid against "
                "the request's requested_schema",
            ),
        ]
        | None
    ) = None
    content_blocks: (
        Annotated[
            list[ContentBlock],
            Field(
                max_length=MAX_MEDIA_ITEMS,
                description="text and media attached to the answer; the model sees them",
            ),
        ]
        | None
    ) = None

    @field_validator("content_blocks")
    @classmethod
    def _bounded_media(cls, value: list[Any] | None) -> list[Any] | None:
        check_media_total(value or ())
        return value


class PendingRequest(BaseModel):
    request_id: str
    task_id: str
    turn_id: str
    kind: Literal["permission", "question", "outcome_unknown", "elicitation"]
    question: str
    tool_call: dict[str, Any] | None
    created_at: int
    expires_at: int


class Pending(BaseModel):
    pending: list[PendingRequest]


class Resumed(BaseModel):
    status: Literal["resumed"]
    request_id: str


def _ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def _describe(row: HitlRequestRecord, task_name: str) -> dict[str, Any]:
    return {
        "request_id": row.request_id,
        "task_id": task_name,
        "turn_id": row.turn_id,
        "kind": row.kind,
        "question": row.question,
        "tool_call": row.tool_call,
        "created_at": _ms(row.created_at),
        "expires_at": _ms(row.expires_at),
    }


@router.get(
    "/hitl/pending",
    response_model=Pending,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="Questions waiting for an answer from this tenant",
)
async def pending(
    state: StateDep,
    tenant: TenantDep,
    task_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
) -> dict[str, Any]:
    query = (
        select(HitlRequestRecord, Task.name)
        .join(Task, Task.id == HitlRequestRecord.task_id)
        .where(
            HitlRequestRecord.tenant_id == tenant,
            HitlRequestRecord.status == "pending",
            HitlRequestRecord.expires_at > datetime.now(UTC),
        )
        .order_by(HitlRequestRecord.created_at)
    )
    if task_id is not None:
        query = query.where(Task.name == task_id)
    async with state.sessions() as session:
        rows = (await session.execute(query)).all()
    return {"pending": [_describe(row, name) for row, name in rows]}


@router.post(
    "/hitl/respond",
    response_model=Resumed,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404, 409, 410),
    summary="Answer a pending permission prompt, question or unknown tool outcome",
)
async def respond(
    state: StateDep, tenant: TenantDep, body: Annotated[HitlAnswer, Body()]
) -> dict[str, str]:
    async with state.sessions() as session:
        task = await find_task(session, tenant, body.task_id)
    if task is None:
        raise ApiError(404, ErrorCode.HITL_NOT_FOUND, "no pending request matches")
    row = await _find(state, tenant, task.id, body)
    allowed = _ANSWERS.get(row.kind)
    if allowed is not None and body.answer.strip().lower() not in allowed:
        raise ApiError(
            422,
            ErrorCode.INVALID_REQUEST,
            f"a {row.kind} request is answered with "
            + " or ".join(f"'{answer}'" for answer in allowed),
            {"request_id": row.request_id, "answers": list(allowed)},
        )
    if row.kind == "elicitation":
        _check_elicited(row, body)
    elif body.content is not None:
        raise ApiError(
            422,
            ErrorCode.INVALID_REQUEST,
            "content answers an elicitation request only",
            {"request_id": row.request_id},
        )
    now = datetime.now(UTC)
    if row.status == "pending" and row.expires_at <= now:
        raise ApiError(410, ErrorCode.HITL_EXPIRED, f"request {row.request_id} has expired")
    async with state.sessions.begin() as session:
        answered = await session.scalar(
            update(HitlRequestRecord)
            .where(
                HitlRequestRecord.request_id == row.request_id,
                HitlRequestRecord.status == "pending",
            )
            .values(
                status="answered",
                answer=body.answer,
                feedback=body.feedback,
                answer_content=_stored_content(body),
                answered_at=now,
            )
            .returning(HitlRequestRecord.request_id)
        )
    if answered is None:
        raise ApiError(
            409, ErrorCode.HITL_ALREADY_ANSWERED, f"request {row.request_id} was already answered"
        )
    if row.kind == "elicitation":
        # Its turn waits with the call, on a worker: wake it to read the answer.
        wake = elicitation_answered_key(state.keys.prefix, row.request_id)
        async with state.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(wake, "answered")
            pipe.expire(wake, _WAKE_TTL_SECONDS)
            await pipe.execute()
        return {"status": "resumed", "request_id": row.request_id}
    # The turn is parked: no worker holds it. Any worker takes this job, reads
    # the answer back and continues the turn from its snapshot.
    job = TurnJob.resuming(tenant, row.task_id, row.turn_id)
    await queue_turn(state.redis, state.keys, job)
    return {"status": "resumed", "request_id": row.request_id}


def _stored_content(body: HitlAnswer) -> dict[str, Any] | None:
    stored: dict[str, Any] = {}
    if body.content_blocks is not None:
        stored["blocks"] = as_stored(body.content_blocks)
    if body.content is not None:
        stored["content"] = body.content
    return stored or None


def _check_elicited(row: HitlRequestRecord, body: HitlAnswer) -> None:
    """An elicitation's answer: ``accept`` carries ``content`` the server's
    schema takes (422 naming each field that is wrong, nothing written);
    ``decline`` and ``cancel`` carry none."""
    action = body.answer.strip().lower()
    details: dict[str, Any] = {"request_id": row.request_id}
    if action != "accept":
        if body.content is not None:
            raise ApiError(
                422,
                ErrorCode.INVALID_REQUEST,
                f"an elicitation answered {action} takes no content",
                details,
            )
        return
    if body.content is None:
        raise ApiError(
            422,
            ErrorCode.INVALID_REQUEST,
            "an elicitation answered accept needs content (the form's values)",
            details,
        )
    schema = (row.tool_call or {}).get("requested_schema") or {"type": "object"}
    try:
        validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
        found = sorted(validator.iter_errors(body.content), key=lambda e: list(e.path))
    except SchemaError:
        # The server's schema is its own; an answer cannot be checked against a broken one.
        found = []
    if found:
        problems = [
            {"field": ".".join(str(p) for p in error.path) or None, "error": error.message}
            for error in found[:20]
        ]
        raise ApiError(
            422,
            ErrorCode.INVALID_REQUEST,
            "the content does not match the requested schema: "
            + "; ".join(
                f"{p['field']}: {p['error']}" if p["field"] else str(p["error"]) for p in problems
            ),
            {**details, "errors": problems},
        )


async def _find(state: StateDep, tenant: str, task_id: str, body: HitlAnswer) -> HitlRequestRecord:
    query = select(HitlRequestRecord).where(
        HitlRequestRecord.tenant_id == tenant,
        # A child's question shows in its parent's stream: it is answered through the parent.
        HitlRequestRecord.task_id.in_(with_subagents(task_id)),
    )
    if body.request_id is not None:
        query = query.where(HitlRequestRecord.request_id == body.request_id)
    else:
        # Without an id, the task's open request is meant (the newest one).
        query = query.where(HitlRequestRecord.status == "pending")
    async with state.sessions() as session:
        row = await session.scalar(query.order_by(HitlRequestRecord.created_at.desc()).limit(1))
    if row is None:
        raise ApiError(404, ErrorCode.HITL_NOT_FOUND, "no pending request matches")
    if row.status == "answered":
        raise ApiError(
            409, ErrorCode.HITL_ALREADY_ANSWERED, f"request {row.request_id} was already answered"
        )
    if row.status in ("expired", "cancelled"):
        raise ApiError(410, ErrorCode.HITL_EXPIRED, f"request {row.request_id} is {row.status}")
    return row
