"""Double-texting: a message for a task whose turn is still running (``on_busy``).

``reject`` (the default) is :func:`~holdfast_gateway.turns.start_turn`'s 409.
The other modes store the message as a pending turn (``holdfast_shared.turnqueue``)
in one transaction that writes nothing when it is refused (404, 409
``TURN_QUEUE_FULL``), and commit it before the response starts:

* ``enqueue`` waits for the running turn to end, then runs (FIFO per task);
* ``interrupt`` also cancels the running turn (as ``POST /execute/cancel``:
  its partial output is kept; a parked turn's question is closed) and runs
  as soon as it has ended, ahead of enqueued messages;
* ``steer`` joins the running turn at its next iteration boundary — or, when
  that turn ends first (or is parked and never resumed), runs as the next
  turn. A steer sent to a parked turn waits for the answer like the turn.

A task that is idle with nothing waiting takes the message as an ordinary
turn whatever the mode. The response streams from where the message enters
the log: the new turn's ``started`` (enqueue, interrupt, a steer run as a
turn) or the ``user_message`` event of a steer, to the end of the turn it is
part of; until then only heartbeats flow.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from holdfast_shared.conversation import user_content
from holdfast_shared.db.models import EventRecord, Message, Turn
from holdfast_shared.errors import ErrorCode
from holdfast_shared.eventlog import LoggedEvent
from holdfast_shared.events import UserMessage, parse_event, turn_of
from holdfast_shared.ids import new_id
from holdfast_shared.turnqueue import PENDING_BY_MODE, count_pending, start_next
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway.cancelling import request_cancel
from holdfast_gateway.errors import ApiError
from holdfast_gateway.limits import check_waiting_turn
from holdfast_gateway.sse import SseResponse, event_frames, frame, sse_response
from holdfast_gateway.state import GatewayState
from holdfast_gateway.storagequota import check_storage
from holdfast_gateway.tasks import TaskRef, find_task, lock_task
from holdfast_gateway.turns import StartedTurn, start_turn

# How often a stream still waiting for its message checks the message is there.
_GONE_CHECK_SECONDS = 10.0
_BUSY_CODES = frozenset({ErrorCode.TURN_IN_PROGRESS, ErrorCode.HITL_REQUIRED})


class TurnOptions(TypedDict):
    """What a message asks of its turn besides its text (``POST /execute``'s fields)."""

    task_id: str | None
    agent: str | None
    model: str | None
    media: list[dict[str, Any]]
    user_id: str
    # The turn's webhook subscription, checked (webhooks.accepted); None: the tenant's default.
    webhook: dict[str, Any] | None
    # Written first in the message's transaction (start_turn's ``claim``): its
    # Idempotency-Key.
    claim: Callable[[AsyncSession, TaskRef, str], Awaitable[None]] | None


@dataclass(frozen=True, slots=True)
class PendingTurn:
    """A message stored to wait for its task; ``turn_id`` is the id it runs as
    (and a steer's ``message_id``)."""

    task: TaskRef
    turn_id: str
    mode: str
    after_seq: int


async def send(
    state: GatewayState,
    tenant_id: str,
    mode: str,
    message: str,
    **options: Unpack[TurnOptions],
) -> StartedTurn | PendingTurn:
    """Start the message's turn now, or store it to wait as ``mode`` says."""
    task_id = options["task_id"]
    if task_id is None or not await _has_pending(state, tenant_id, task_id):
        # Nothing waits: an idle task takes it as an ordinary turn. (Something
        # waiting keeps its place: the message goes behind it, never ahead.)
        try:
            return await start_turn(state, tenant_id, message=message, **options)
        except ApiError as exc:
            if exc.code not in _BUSY_CODES or task_id is None:
                raise
    assert task_id is not None
    pending = await _store(state, tenant_id, task_id, mode, message, options)
    if mode == "interrupt":
        await _cancel_running(state, tenant_id, pending.task.id)
    # The running turn may have ended between our look and the commit, its
    # worker finding nothing to start: start it here if so.
    await start_next(
        state.sessions, state.redis, state.keys, state.lock, state.eventlog, pending.task.id
    )
    return pending


async def _has_pending(state: GatewayState, tenant_id: str, name: str) -> bool:
    async with state.sessions() as session:
        task = await find_task(session, tenant_id, name)
        return task is not None and await count_pending(session, task.id) > 0


async def _store(
    state: GatewayState,
    tenant_id: str,
    name: str,
    mode: str,
    message: str,
    options: TurnOptions,
) -> PendingTurn:
    await check_storage(state, tenant_id)
    turn_id = new_id("turn")
    async with state.sessions.begin() as session:
        task = await find_task(session, tenant_id, name)
        if task is None:  # deleted since it refused the message as busy
            raise ApiError(404, ErrorCode.TASK_NOT_FOUND, f"no task {name!r}", {"task_id": name})
        # Locks in start_turn's order (the task's row, the Idempotency-Key, the
        # tenant's turn count): a request for this task that tries to start
        # first and one that stores itself to wait can race with one key, and
        # taking them in another order deadlocked the two.
        # The task's row lock orders its queue: the bound below holds under
        # concurrent requests, and arrival order is commit order.
        # It also excludes DELETE /tasks (which locks it first): gone by now, a 404.
        locked = await lock_task(session, tenant_id, name)
        if locked is None or locked.id != task.id:
            raise ApiError(404, ErrorCode.TASK_NOT_FOUND, f"no task {name!r}", {"task_id": name})
        if options["claim"] is not None:
            await options["claim"](session, task, turn_id)
        await check_waiting_turn(session, state.settings, tenant_id)
        waiting = await count_pending(session, task.id)
        limit = state.settings.max_queued_turns
        if waiting >= limit:
            raise ApiError(
                409,
                ErrorCode.TURN_QUEUE_FULL,
                f"task {name!r} already has {waiting} messages waiting for it "
                f"(HOLDFAST_MAX_QUEUED_TURNS={limit}); send this one once a turn ended",
                {"task_id": name, "queued": waiting, "limit": limit},
            )
        after_seq = await last_seq(state, task.id)
        session.add(
            Turn(
                id=turn_id,
                task_id=task.id,
                status=PENDING_BY_MODE[mode],
                agent=options["agent"],
                model=options["model"],
                user_id=options["user_id"],
                **({"webhook": options["webhook"]} if options["webhook"] is not None else {}),
            )
        )
        await session.flush()
        session.add(
            Message(
                task_id=task.id,
                turn_id=turn_id,
                position=0,
                role="user",
                content=user_content(message, options["media"]),
            )
        )
    return PendingTurn(task, turn_id, mode, after_seq)


async def last_seq(state: GatewayState, task_id: str) -> int:
    """The task's last logged seq: the message enters the log after it."""
    hot = await state.eventlog.last_hot_seq(task_id)
    if hot is not None:
        return hot
    async with state.sessions() as session:
        found = await session.scalar(
            select(func.max(EventRecord.seq)).where(EventRecord.task_id == task_id)
        )
    return int(found or 0)


async def _cancel_running(state: GatewayState, tenant_id: str, task_id: str) -> None:
    """Cancel the task's running turn the way ``POST /execute/cancel`` does."""
    turn_id = await state.lock.holder(task_id)
    if turn_id is not None:
        await request_cancel(state, tenant_id, task_id, turn_id)


def _entry_of(event: LoggedEvent, message_id: str) -> str | None:
    """The turn the pending message ``message_id`` entered with this event, if it did."""
    if event.type == "user_message":
        parsed = parse_event(event.data)
        if isinstance(parsed, UserMessage) and parsed.message_id == message_id:
            return turn_of(event.data)
        return None
    # Its ``started``, or (a promotion that died before logging it) its first event.
    return message_id if turn_of(event.data) == message_id else None


async def pending_frames(state: GatewayState, pending: PendingTurn) -> AsyncIterator[str]:
    """The events of the turn the message joins, from the one where it enters
    (heartbeats only, meanwhile) to that turn's end. Ends without an event if
    the message is gone without entering the log (its task was deleted)."""
    task_id = pending.task.id
    last = pending.after_seq
    sub = await state.hub.subscribe(task_id)
    entry: tuple[LoggedEvent, str] | None = None
    from_log = True  # what came before we subscribed, or a gap
    try:
        while entry is None:
            if from_log:
                from_log = False
                async for page in state.reads.pages_after(task_id, last):
                    entry = _find(page, pending.turn_id)
                    if entry is not None:
                        break
                    last = page[-1].seq if page else last
                continue
            try:
                batch = await asyncio.wait_for(sub.queue.get(), _GONE_CHECK_SECONDS)
            except TimeoutError:
                if await _gone(state, pending.turn_id):
                    # Taken into a turn (its event was logged first), or
                    # deleted with its task (then nothing will come).
                    entry = await find_in_log(state, task_id, last, pending.turn_id)
                    if entry is None:
                        return
                continue
            if batch is None:
                return  # the gateway is shutting down
            if batch[-1].seq <= last:
                continue
            if batch[0].seq > last + 1 or sub.overflowed:
                sub.overflowed = False
                from_log = True
                continue
            entry = _find(batch, pending.turn_id)
            last = batch[-1].seq
    finally:
        state.hub.unsubscribe(sub)
    event, turn_id = entry
    yield frame(event)
    hub, log = state.hub, state.reads
    async for chunk in event_frames(hub, log, task_id, event.seq, stop_turn=turn_id):
        yield chunk


async def _gone(state: GatewayState, turn_id: str) -> bool:
    """The message's pending turn row is no more (a started one stays)."""
    async with state.sessions() as session:
        return await session.scalar(select(Turn.id).where(Turn.id == turn_id)) is None


async def find_in_log(
    state: GatewayState, task_id: str, after_seq: int, message_id: str
) -> tuple[LoggedEvent, str] | None:
    async for page in state.reads.pages_after(task_id, after_seq):
        found = _find(page, message_id)
        if found is not None:
            return found
    return None


def _find(events: list[LoggedEvent], message_id: str) -> tuple[LoggedEvent, str] | None:
    for event in events:
        turn_id = _entry_of(event, message_id)
        if turn_id is not None:
            return event, turn_id
    return None


async def respond(
    state: GatewayState,
    tenant_id: str,
    mode: str,
    message: str,
    **options: Unpack[TurnOptions],
) -> SseResponse:
    """``POST /execute`` with an ``on_busy`` other than ``reject``: the SSE
    response of the turn the message starts or joins (``X-Turn-Id``: the
    message's turn id, which a steer's ``user_message`` names)."""
    outcome = await send(state, tenant_id, mode, message, **options)
    if isinstance(outcome, StartedTurn):
        started = outcome

        async def frames() -> AsyncIterator[str]:
            yield frame(started.started)
            async for chunk in event_frames(
                state.hub,
                state.reads,
                started.task.id,
                started.started.seq,
                stop_turn=started.turn_id,
            ):
                yield chunk

        stream, queued = frames(), "no"
    else:
        stream, queued = pending_frames(state, outcome), mode
    task = outcome.task
    return sse_response(
        stream,
        task.name,
        state.settings.heartbeat_seconds,
        # X-Queued: the mode the message waits by, "no" when it started at once.
        headers={"X-Task-Id": task.name, "X-Turn-Id": outcome.turn_id, "X-Queued": queued},
    )
