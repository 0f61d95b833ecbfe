"""The completion webhooks' outbox, as the loop-worker writes it.

A turn's end (``turn/live.py``, in the one statement that records it) and a
question it asks (``hitl.py``, in the transaction that stores it) each add
one ``webhook_deliveries`` row when the turn's subscription (its own
``webhook``, else the tenant's default) names that event. The subscription is
read by the statement itself, so a turn nobody subscribed to costs no round
trip. A gateway signs and posts the row later (gateway ``webhooks/``).

The row's id is made from what it reports, so the statement written again
(a turn's end recorded again by the worker that took it over) adds nothing:
one message per event, whatever crashed in between.
"""

from __future__ import annotations

from typing import Any

from holdfast_shared.db.models import Turn, WebhookDelivery, WebhookTenant
from holdfast_shared.webhooks import WebhookEvent, question_event
from sqlalchemy import func, literal, select
from sqlalchemy.dialects.postgresql import JSONB, Insert, insert

from holdfast_loop_worker.trajectory import TurnEnding


def turn_end_id(turn_id: str, event: WebhookEvent) -> str:
    """The ``webhook-id`` of a turn's end."""
    return f"msg_{turn_id}_{event}"


def question_id(request_id: str) -> str:
    """The ``webhook-id`` of a question (a request id is unique already)."""
    return f"msg_{request_id}"


def outbox_insert(
    *,
    delivery_id: str,
    tenant_id: str,
    task_id: str,
    turn_id: str,
    event: WebhookEvent,
    data: dict[str, Any],
) -> Insert:
    """The statement adding the delivery of ``event`` when the turn's subscription
    names it (nothing otherwise, nor when the row exists already)."""
    own = select(Turn.webhook).where(Turn.id == turn_id).scalar_subquery()
    default = (
        select(WebhookTenant.default_webhook)
        .where(WebhookTenant.tenant_id == tenant_id)
        .scalar_subquery()
    )
    subscription = select(func.coalesce(own, default, type_=JSONB).label("webhook")).subquery()
    webhook = subscription.c.webhook
    rows = select(
        literal(delivery_id),
        literal(tenant_id),
        literal(task_id),
        literal(turn_id),
        literal(event),
        webhook["url"].astext,
        literal(data, JSONB),
    ).where(webhook.is_not(None), webhook["events"].contains([event]))
    columns = ["id", "tenant_id", "task_id", "turn_id", "event", "url", "data"]
    return (
        insert(WebhookDelivery)
        .from_select(columns, rows)
        .on_conflict_do_nothing(index_elements=[WebhookDelivery.id])
    )


_END_EVENTS: dict[str, WebhookEvent] = {
    "completed": "completed",
    "errored": "errored",
    "cancelled": "cancelled",
}


def turn_end_insert(ending: TurnEnding, *, last_seq: int | None) -> Insert:
    """The delivery of the turn's end (its status is the event), for the statement
    that records it. ``last_seq``: its terminal event's, where a receiver replays from."""
    event = _END_EVENTS.get(ending.status, "errored")
    data = {
        "task_name": ending.task_name,
        "status": ending.status,
        "stop_reason": ending.stop_reason,
        "error": ending.error,
        "usage": ending.usage,
        "last_seq": last_seq or None,
    }
    return outbox_insert(
        delivery_id=turn_end_id(ending.turn_id, event),
        tenant_id=ending.tenant_id,
        task_id=ending.task_id,
        turn_id=ending.turn_id,
        event=event,
        data=data,
    )


def question_insert(
    *,
    tenant_id: str,
    task_id: str,
    turn_id: str,
    request_id: str,
    kind: str,
    question: str,
    tool_call: dict[str, Any] | None,
    expires_at_ms: int,
) -> Insert:
    """The delivery of a question the turn asks, for the transaction that stores it."""
    data = {
        "status": "parked",
        "request_id": request_id,
        "kind": kind,
        "question": question,
        "tool_call": tool_call,
        "expires_at_ms": expires_at_ms,
    }
    return outbox_insert(
        delivery_id=question_id(request_id),
        tenant_id=tenant_id,
        task_id=task_id,
        turn_id=turn_id,
        event=question_event(kind),
        data=data,
    )
