"""Human-in-the-loop: ``GET /hitl/pending`` and ``POST /hitl/respond``.

An answer is recorded first (a conditional update, so two answers cannot
both win), then a resume job is queued: the waiting turn holds no worker, so
whichever worker takes the job continues it, emits ``hitl_resolved`` and
goes on — also days later and after every process restarted.
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
from holdfast_shared.jobs import TurnJob
from holdfast_shared.turnqueue import queue_turn
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy import select, update

from holdfast_gateway import errors
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep
from holdfast_gateway.errors import ApiError
from holdfast_gateway.tasks import find_task

router = APIRouter(tags=["hitl"])


class HitlAnswer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: Annotated[str, Field(pattern=ID_PATTERN)]
    request_id: Annotated[str | None, Field(pattern=ID_PATTERN)] = None
    answer: Annotated[Text, Field(min_length=1, max_length=100_000)]
    feedback: Annotated[Text, Field(max_length=100_000)] | None = None
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
    kind: Literal["permission", "question"]
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
    summary="Answer a pending permission prompt or question",
)
async def respond(
    state: StateDep, tenant: TenantDep, body: Annotated[HitlAnswer, Body()]
) -> dict[str, str]:
    async with state.sessions() as session:
        task = await find_task(session, tenant, body.task_id)
    if task is None:
        raise ApiError(404, ErrorCode.HITL_NOT_FOUND, "no pending request matches")
    row = await _find(state, tenant, task.id, body)
    if row.kind == "permission" and body.answer.strip().lower() not in ("yes", "no"):
        raise ApiError(
            422,
            ErrorCode.INVALID_REQUEST,
            "a permission request is answered with 'yes' or 'no'",
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
                answer_content=(
                    {"blocks": as_stored(body.content_blocks)}
                    if body.content_blocks is not None
                    else None
                ),
                answered_at=now,
            )
            .returning(HitlRequestRecord.request_id)
        )
    if answered is None:
        raise ApiError(
            409, ErrorCode.HITL_ALREADY_ANSWERED, f"request {row.request_id} was already answered"
        )
    # The turn is parked: no worker holds it. Any worker takes this job, reads
    # the answer back and continues the turn from its snapshot.
    job = TurnJob.resuming(tenant, row.task_id, row.turn_id)
    await queue_turn(state.redis, state.keys, job)
    return {"status": "resumed", "request_id": row.request_id}


async def _find(state: StateDep, tenant: str, task_id: str, body: HitlAnswer) -> HitlRequestRecord:
    query = select(HitlRequestRecord).where(
        HitlRequestRecord.tenant_id == tenant, HitlRequestRecord.task_id == task_id
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
