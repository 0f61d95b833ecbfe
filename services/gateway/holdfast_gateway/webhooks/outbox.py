"""The outbox as gateways work it: claiming due deliveries, their bodies, their outcomes.

Any number of gateways poll the same table. A claim takes due rows with
``FOR UPDATE SKIP LOCKED`` (no two gateways take one row) and marks them
``delivering`` until ``next_attempt_at``, a lease: a gateway that dies
mid-attempt leaves the row due again once it runs out, and another sends it
(at-least-once; the ``webhook-id`` lets the receiver drop the second copy).
An outcome is recorded only by the claim that made the attempt (its attempt
number), so a late answer never overwrites a newer claim's.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.db.models import Message, Task, Turn, WebhookDelivery
from holdfast_shared.webhooks import MESSAGE_TYPES
from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

DUE = ("pending", "delivering")


async def claim_due(session: AsyncSession, *, limit: int, hold: timedelta) -> list[WebhookDelivery]:
    """Up to ``limit`` due deliveries, each held by this caller for ``hold`` and
    counted as one more attempt."""
    due = (
        select(WebhookDelivery.id)
        .where(WebhookDelivery.status.in_(DUE), WebhookDelivery.next_attempt_at <= func.now())
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    claimed = await session.scalars(
        update(WebhookDelivery)
        .where(WebhookDelivery.id.in_(due.scalar_subquery()))
        .values(
            status="delivering",
            attempts=WebhookDelivery.attempts + 1,
            next_attempt_at=func.now() + hold,
        )
        .returning(WebhookDelivery)
    )
    return list(claimed)


async def body_of(session: AsyncSession, row: WebhookDelivery) -> str:
    """The message's body: built on its first attempt from what the writer knew
    and the turn's answer, then kept, so every attempt sends the same bytes."""
    if row.body is not None:
        return row.body
    data: dict[str, Any] = dict(row.data)
    task_name = data.pop("task_name", None) or await session.scalar(
        select(Task.name).where(Task.id == row.task_id)
    )
    data = {"task_id": task_name or row.task_id, "turn_id": row.turn_id, **data}
    if row.event in ("completed", "errored", "cancelled"):
        data["result"] = await session.scalar(select(Turn.result).where(Turn.id == row.turn_id))
        data["text"] = await _answer_text(session, row.turn_id)
    message = {
        "type": MESSAGE_TYPES.get(row.event, f"turn.{row.event}"),
        "timestamp": row.created_at.astimezone(UTC).isoformat(),
        "data": data,
    }
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False)
    kept = await session.scalar(
        update(WebhookDelivery)
        .where(WebhookDelivery.id == row.id)
        .values(body=func.coalesce(WebhookDelivery.body, body))
        .returning(WebhookDelivery.body)
    )
    return kept or body


async def _answer_text(session: AsyncSession, turn_id: str) -> str | None:
    """The text of the turn's last assistant message (None: it wrote none)."""
    content = await session.scalar(
        select(Message.content)
        .where(Message.turn_id == turn_id, Message.role == "assistant")
        .order_by(Message.position.desc())
        .limit(1)
    )
    if content is None:
        return None
    return ChatMessage(role="assistant", blocks=tuple(content.get("blocks", ()))).text


def _held_by(row_id: str, attempt: int) -> Any:
    return (
        (WebhookDelivery.id == row_id)
        & (WebhookDelivery.status == "delivering")
        & (WebhookDelivery.attempts == attempt)
    )


async def delivered(session: AsyncSession, row_id: str, attempt: int, status: int) -> None:
    await session.execute(
        update(WebhookDelivery)
        .where(_held_by(row_id, attempt))
        .values(
            status="delivered",
            delivered_at=func.now(),
            last_status=status,
            last_error=None,
        )
    )


async def attempt_failed(
    session: AsyncSession,
    row_id: str,
    attempt: int,
    *,
    error: str,
    status: int | None,
    retry_in: float | None,
) -> None:
    """A failed attempt: tried again in ``retry_in`` seconds, or (None) dead-lettered."""
    values: dict[str, Any] = {"last_error": error[:2000], "last_status": status}
    if retry_in is None:
        values["status"] = "failed"
    else:
        values["status"] = "pending"
        values["next_attempt_at"] = datetime.now(UTC) + timedelta(seconds=retry_in)
    await session.execute(update(WebhookDelivery).where(_held_by(row_id, attempt)).values(values))


async def forget_before(session: AsyncSession, cutoff: datetime, *, limit: int = 1000) -> int:
    """Delete up to ``limit`` settled deliveries (delivered or failed) made before
    ``cutoff``; how many went."""
    old = (
        select(WebhookDelivery.id)
        .where(
            WebhookDelivery.status.in_(("delivered", "failed")),
            WebhookDelivery.created_at < cutoff,
        )
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    gone = await session.execute(
        delete(WebhookDelivery).where(WebhookDelivery.id.in_(old.scalar_subquery()))
    )
    return int(gone.rowcount or 0)  # type: ignore[attr-defined]


async def redeliver(session: AsyncSession, tenant_id: str, row_id: str) -> WebhookDelivery | None:
    """The delivery due again now with a fresh count of attempts (one being tried
    is left as it is); None when the tenant has none of that id."""
    row = await session.scalar(
        select(WebhookDelivery)
        .where(WebhookDelivery.id == row_id, WebhookDelivery.tenant_id == tenant_id)
        .with_for_update()
    )
    if row is None or row.status in DUE:
        return row
    row.status = "pending"
    row.attempts = 0
    row.next_attempt_at = datetime.now(UTC)
    row.delivered_at = None
    await session.flush()
    return row
