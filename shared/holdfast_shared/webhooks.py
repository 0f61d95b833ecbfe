"""Completion webhooks on the wire: what a subscription may ask for.

A subscription is ``{"url": ..., "events": [...]}``, given per request
(``webhook`` on ``/execute``, ``/v1/execution``, schedules) and stored on the
turn's row, or set as the tenant's default. The loop-worker writes a
delivery to the outbox for each event a turn's subscription names (in the
transaction that records it); a gateway signs and posts it.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

WebhookEvent = Literal["completed", "errored", "cancelled", "hitl_request", "outcome_unknown"]
"""A turn's end (``completed``, ``errored``, ``cancelled``), or a question it
asks: ``outcome_unknown`` for an effectful tool call whose outcome nobody
knows, ``hitl_request`` for any other (a permission, the model's question)."""

WEBHOOK_EVENTS: tuple[WebhookEvent, ...] = get_args(WebhookEvent)

# PostgreSQL notifies this channel when a delivery becomes due now (migration
# 0018's trigger); gateways LISTEN to it.
DUE_CHANNEL = "holdfast_webhooks_due"

# The Standard Webhooks ``type`` of each event's message.
MESSAGE_TYPES: dict[str, str] = {event: f"turn.{event}" for event in WEBHOOK_EVENTS}


class WebhookSpec(BaseModel):
    """Where to post the turn's events, and which."""

    model_config = ConfigDict(extra="forbid")

    url: Annotated[
        str,
        Field(
            pattern=r"^https?://[!-~]+$",
            max_length=2048,
            description="where each message is POSTed (signed per Standard Webhooks)",
        ),
    ]
    events: Annotated[
        list[WebhookEvent],
        Field(
            min_length=1,
            max_length=len(WEBHOOK_EVENTS),
            description="which to send: the turn's end (`completed`, `errored`, `cancelled`) "
            "and its questions (`hitl_request`, `outcome_unknown`); default: all",
        ),
    ] = list(WEBHOOK_EVENTS)

    @field_validator("events")
    @classmethod
    def _once_each(cls, value: list[WebhookEvent]) -> list[WebhookEvent]:
        return list(dict.fromkeys(value))


def question_event(kind: str) -> WebhookEvent:
    """The webhook event of a question of ``kind`` (hitl_requests.kind)."""
    return "outcome_unknown" if kind == "outcome_unknown" else "hitl_request"


__all__ = [
    "DUE_CHANNEL",
    "MESSAGE_TYPES",
    "WEBHOOK_EVENTS",
    "WebhookEvent",
    "WebhookSpec",
    "question_event",
]
