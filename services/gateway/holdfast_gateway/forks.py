"""Edit and retry on ``POST /execute``: fork the conversation before the new turn.

``edit_message_id`` names an earlier user message of the task: it and every
later message leave the current branch, and the request's ``message`` opens
the new turn in its place. ``retry_message_id`` names a user message to be
answered again: it and everything after it (its old answer included) leave
the branch, and the new turn opens with the same content (text and media).
Either way the retried or edited message is a turn's opening message
(position 0) on the current branch; anything else is a 422 naming the field.

:func:`fork_for_turn` runs inside :func:`~holdfast_gateway.turns.start_turn`'s
transaction, after the task's turn lock is taken: no turn writes messages
meanwhile, and a refusal (422, 404) rolls the fork back with the turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from holdfast_shared.branches import ON_CURRENT_BRANCH, take_off_after
from holdfast_shared.db.models import Message
from holdfast_shared.errors import ErrorCode
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway.errors import ApiError

ForkField = Literal["edit_message_id", "retry_message_id"]
_REASONS: dict[ForkField, str] = {"edit_message_id": "edit", "retry_message_id": "retry"}


@dataclass(frozen=True, slots=True)
class ForkRequest:
    """What the client asked: which field, naming which message."""

    field: ForkField
    message_id: int

    @property
    def reason(self) -> str:
        return _REASONS[self.field]


@dataclass(frozen=True, slots=True)
class Forked:
    """The fork made for a new turn."""

    fork_id: str
    reason: str
    # The first turn that left the branch: the edited or retried message's.
    from_turn_id: str
    # The message the new turn opens with, for a retry (None: the request's).
    content: dict[str, Any] | None


def invalid_field(field: str, message: str, kind: str = "value_error") -> ApiError:
    """A 422 ``INVALID_REQUEST`` naming ``field`` of the body, shaped as the
    gateway's validation errors are (``details.errors[].loc``)."""
    details = {"errors": [{"loc": ["body", field], "msg": message, "type": kind}]}
    return ApiError(422, ErrorCode.INVALID_REQUEST, f"invalid request: {field}: {message}", details)


async def fork_for_turn(session: AsyncSession, task_id: str, request: ForkRequest) -> Forked:
    """Take the named message and everything after it off the task's current
    branch; 422 naming the field when it is not a user's message on it."""
    row = (
        await session.execute(
            select(
                Message.id,
                Message.turn_id,
                Message.role,
                Message.position,
                Message.content,
                Message.taken_off_by,
            ).where(Message.id == request.message_id, Message.task_id == task_id)
        )
    ).first()
    if row is None:
        raise invalid_field(
            request.field, f"the task has no message {request.message_id}", "unknown_message"
        )
    if row.taken_off_by is not None:
        raise invalid_field(
            request.field,
            f"message {request.message_id} is not on the conversation's current branch "
            f"(fork {row.taken_off_by} took it off)",
            "message_off_branch",
        )
    if row.role != "user" or row.position != 0:
        raise invalid_field(
            request.field,
            f"message {request.message_id} is not a message the user sent "
            "(only the message that opened a turn can be edited or retried)",
            "not_a_user_message",
        )
    last_kept = await session.scalar(
        select(func.max(Message.id)).where(
            Message.task_id == task_id, ON_CURRENT_BRANCH, Message.id < row.id
        )
    )
    fork_id = await take_off_after(session, task_id, last_kept, reason=request.reason)
    content = dict(row.content) if request.field == "retry_message_id" else None
    return Forked(fork_id, request.reason, row.turn_id, content)
