"""``Idempotency-Key`` on ``POST /execute``: one message, one turn, however often sent.

A client that lost a response (a dropped connection, a gateway that stalled
and answered late) cannot tell whether its message started a turn; sending
it again without a key could run it twice. With a key (any printable ASCII,
up to 255 characters, unique per message: a UUID does) the first request
records the key in the transaction that stores the message (``ExecuteKey``),
and every later one with the key streams that turn, from its start, with
``Idempotent-Replayed: true``, whatever became of the first request. Two
requests racing with one key start one turn: the second's transaction finds
the key taken (:class:`KeyTaken`), writes nothing and follows the first.

The key is the tenant's; sent again with another request (another message,
task or option) it is a 422 ``IDEMPOTENCY_KEY_REUSED``. It lives as long as
its turn: a task deleted frees its keys, and so does a turn taken back before
it started (its gateway stalled past the stale-turn sweep): a request that
meets the key's turn committed but not yet started is answered 503 with
``Retry-After: 1`` rather than follow a turn that may never come.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable

from holdfast_shared.db.models import ExecuteKey, Task, Turn
from holdfast_shared.errors import ErrorCode
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway import busy
from holdfast_gateway.errors import ApiError
from holdfast_gateway.sse import SseResponse, sse_response
from holdfast_gateway.state import GatewayState
from holdfast_gateway.tasks import TaskRef

HEADER = "Idempotency-Key"
# Printable ASCII without spaces (RFC 9110 token characters and more): a UUID,
# a ULID or a client's own message id.
PATTERN = r"^[\x21-\x7e]{1,255}$"

# How long a repeat waits for the first request's ``started`` before a 503.
_STARTING_SECONDS = 2.0
_STARTING_POLL_SECONDS = 0.05

Recorder = Callable[[AsyncSession, TaskRef, str], Awaitable[None]]


class KeyTaken(Exception):
    """Another request recorded the key first (raised inside the message's
    transaction, which then writes nothing)."""


def fingerprint(request: BaseModel) -> str:
    """The request as validated (so the order of its JSON fields does not count)."""
    return hashlib.sha256(request.model_dump_json().encode()).hexdigest()


async def earlier(
    state: GatewayState, tenant_id: str, key: str, printed: str
) -> busy.PendingTurn | None:
    """The turn an earlier request with ``key`` started, to follow; None if none did."""
    async with state.sessions() as session:
        row = (
            await session.execute(
                select(ExecuteKey.fingerprint, ExecuteKey.turn_id, ExecuteKey.after_seq)
                .add_columns(Task.id, Task.name, Turn.status)
                .join(Turn, Turn.id == ExecuteKey.turn_id)
                .join(Task, Task.id == Turn.task_id)
                .where(ExecuteKey.tenant_id == tenant_id, ExecuteKey.key == key)
            )
        ).first()
    if row is None:
        return None
    printed_then, turn_id, after_seq, task_id, name, status = row
    if printed_then != printed:
        raise ApiError(
            422,
            ErrorCode.IDEMPOTENCY_KEY_REUSED,
            f"the {HEADER} {key!r} was sent with another request: a key names one message",
            {"idempotency_key": key, "turn_id": turn_id},
        )
    if status == "queued" and not await _started(state, task_id, after_seq, turn_id):
        # Committed, its ``started`` not logged yet: the first request is still
        # starting it, or stalled there and the stale-turn sweep takes it back
        # (the key with it). Following it could mean following a turn that
        # never comes; sent again in a moment, the key finds one or the other.
        raise ApiError(
            503,
            ErrorCode.UNAVAILABLE,
            f"the first request with this {HEADER} is still starting its turn; send it again",
            {"idempotency_key": key, "turn_id": turn_id},
            headers={"Retry-After": "1"},
        )
    return busy.PendingTurn(TaskRef(task_id, name), turn_id, "replayed", after_seq)


async def _started(state: GatewayState, task_id: str, after_seq: int, turn_id: str) -> bool:
    """Whether the turn's ``started`` is logged, or is within a moment (a request
    racing the first one meets the turn just committed, its ``started`` on the way)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + _STARTING_SECONDS
    while await busy.find_in_log(state, task_id, after_seq, turn_id) is None:
        if loop.time() > until:
            return False
        await asyncio.sleep(_STARTING_POLL_SECONDS)
    return True


def recorder(state: GatewayState, tenant_id: str, key: str, printed: str) -> Recorder:
    """What records ``key`` in the transaction that stores the message (``claim``
    of ``start_turn`` and of a waiting message); :class:`KeyTaken` if it was first."""

    async def record(session: AsyncSession, task: TaskRef, turn_id: str) -> None:
        taken = await session.scalar(
            insert(ExecuteKey)
            .values(
                tenant_id=tenant_id,
                key=key,
                fingerprint=printed,
                turn_id=turn_id,
                after_seq=await busy.last_seq(state, task.id),
            )
            .on_conflict_do_nothing()
            .returning(ExecuteKey.key)
        )
        if taken is None:
            raise KeyTaken(key)

    return record


def replay(state: GatewayState, turn: busy.PendingTurn) -> SseResponse:
    """The response to a request sent again: the key's turn, from its start."""
    return sse_response(
        busy.pending_frames(state, turn),
        turn.task.name,
        state.settings.heartbeat_seconds,
        headers={
            "X-Task-Id": turn.task.name,
            "X-Turn-Id": turn.turn_id,
            "Idempotent-Replayed": "true",
        },
    )
