"""``/webhooks``: the tenant's signing secret, its default subscription, and its deliveries.

``POST /webhooks/secret`` makes (or rotates) the secret every message is
signed with and answers it this once. ``PUT /webhooks/default`` subscribes
every turn that gives no ``webhook`` of its own. ``GET /webhooks/deliveries``
lists the outbox (``?status=failed``: the dead letters), and ``POST
/webhooks/deliveries/{id}/redeliver`` sends one again (same ``webhook-id``
and body, a fresh count of attempts).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Path, Query, Response
from holdfast_shared.db.models import Task, WebhookDelivery
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.webhooks import WebhookSpec
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway import errors
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep
from holdfast_gateway.errors import ApiError
from holdfast_gateway.webhooks import accepted, outbox
from holdfast_gateway.webhooks.tenant import default_webhook, rotate_secret, set_default_webhook

router = APIRouter(tags=["webhooks"])

MAX_LISTED = 200
DeliveryStatus = Literal["pending", "delivering", "delivered", "failed"]
DeliveryId = Annotated[
    str, Path(pattern=ID_PATTERN, description="the delivery's id: its messages' webhook-id")
]


class SecretOut(BaseModel):
    secret: str = Field(description="`whsec_` and base64: shown this once; keep it")


class DefaultOut(BaseModel):
    webhook: WebhookSpec | None


class DeliveryOut(BaseModel):
    id: str = Field(description="the message's `webhook-id`, the same on every attempt")
    task_id: str
    turn_id: str
    event: str
    url: str
    status: DeliveryStatus
    attempts: int
    next_attempt_at: datetime | None = Field(description="when pending: its next attempt")
    last_error: str | None
    last_status: int | None = Field(description="the receiver's last HTTP status")
    created_at: datetime
    delivered_at: datetime | None


class DeliveriesOut(BaseModel):
    deliveries: list[DeliveryOut]


def _out(row: WebhookDelivery, task_name: str | None) -> DeliveryOut:
    return DeliveryOut(
        id=row.id,
        task_id=task_name or row.task_id,
        turn_id=row.turn_id,
        event=row.event,
        url=row.url,
        status=row.status,
        attempts=row.attempts,
        next_attempt_at=row.next_attempt_at if row.status in outbox.DUE else None,
        last_error=row.last_error,
        last_status=row.last_status,
        created_at=row.created_at,
        delivered_at=row.delivered_at,
    )


def _not_found(delivery_id: str) -> ApiError:
    return ApiError(
        404,
        ErrorCode.WEBHOOK_DELIVERY_NOT_FOUND,
        f"no webhook delivery {delivery_id!r}",
        {"id": delivery_id},
    )


async def _task_name(session: AsyncSession, task_id: str) -> str | None:
    return await session.scalar(select(Task.name).where(Task.id == task_id))


@router.post(
    "/webhooks/secret",
    status_code=201,
    response_model=SecretOut,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="Create or rotate the tenant's webhook signing secret (returned once)",
)
async def create_secret(state: StateDep, tenant: TenantDep) -> SecretOut:
    assert state.vault is not None, "the gateway starts only with HOLDFAST_ASSET_ENCRYPTION_KEY"
    async with state.sessions.begin() as session:
        secret = await rotate_secret(session, state.vault, tenant)
    return SecretOut(secret=secret)


@router.get(
    "/webhooks/default",
    response_model=DefaultOut,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="The subscription of the tenant's turns that give no webhook",
)
async def get_default(state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    async with state.sessions() as session:
        return {"webhook": await default_webhook(session, tenant)}


@router.put(
    "/webhooks/default",
    response_model=DefaultOut,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY),
    summary="Subscribe the tenant's turns that give no webhook of their own",
)
async def put_default(
    state: StateDep, tenant: TenantDep, body: Annotated[WebhookSpec, Body()]
) -> dict[str, Any]:
    webhook = await accepted(state, tenant, body, ("body",))
    async with state.sessions.begin() as session:
        await set_default_webhook(session, tenant, webhook)
    return {"webhook": webhook}


@router.delete(
    "/webhooks/default",
    status_code=204,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="Remove the tenant's default subscription",
)
async def delete_default(state: StateDep, tenant: TenantDep) -> Response:
    async with state.sessions.begin() as session:
        await set_default_webhook(session, tenant, None)
    return Response(status_code=204)


@router.get(
    "/webhooks/deliveries",
    response_model=DeliveriesOut,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="The tenant's webhook deliveries, newest first (status=failed: dead letters)",
)
async def list_deliveries(
    state: StateDep,
    tenant: TenantDep,
    status: DeliveryStatus | None = None,
    task_id: Annotated[str | None, Query(pattern=ID_PATTERN)] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LISTED)] = 50,
) -> DeliveriesOut:
    query = (
        select(WebhookDelivery, Task.name)
        .outerjoin(Task, Task.id == WebhookDelivery.task_id)
        .where(WebhookDelivery.tenant_id == tenant)
    )
    if status is not None:
        query = query.where(WebhookDelivery.status == status)
    if task_id is not None:
        query = query.where(Task.name == task_id)
    query = query.order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id).limit(limit)
    async with state.sessions() as session:
        rows = (await session.execute(query)).all()
    return DeliveriesOut(deliveries=[_out(row, name) for row, name in rows])


@router.get(
    "/webhooks/deliveries/{delivery_id}",
    response_model=DeliveryOut,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="One webhook delivery",
)
async def get_delivery(state: StateDep, tenant: TenantDep, delivery_id: DeliveryId) -> DeliveryOut:
    async with state.sessions() as session:
        row = await session.scalar(
            select(WebhookDelivery).where(
                WebhookDelivery.id == delivery_id, WebhookDelivery.tenant_id == tenant
            )
        )
        if row is None:
            raise _not_found(delivery_id)
        return _out(row, await _task_name(session, row.task_id))


@router.post(
    "/webhooks/deliveries/{delivery_id}/redeliver",
    status_code=202,
    response_model=DeliveryOut,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="Send a delivery again (a failed one, or a delivered one)",
)
async def redeliver(state: StateDep, tenant: TenantDep, delivery_id: DeliveryId) -> DeliveryOut:
    async with state.sessions.begin() as session:
        row = await outbox.redeliver(session, tenant, delivery_id)
        if row is None:
            raise _not_found(delivery_id)
        return _out(row, await _task_name(session, row.task_id))
