"""Starting a turn: the one place the gateway writes.

Order matters so that a refused request writes nothing and an accepted one
is durable before it is acknowledged. In one transaction: the task (created
if new; another tenant's is a 404) with its row locked against a racing
``DELETE /tasks``, the turn lock (409 when held), the turn
row and the user message; after the commit, the ``started`` event and the
job on the turns stream. A failure after the lock releases it again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from holdfast_shared.conversation import user_content
from holdfast_shared.db.models import HitlRequestRecord, Message, Task, Turn
from holdfast_shared.errors import ErrorCode, Superseded
from holdfast_shared.eventlog import LoggedEvent, next_epoch
from holdfast_shared.events import ErrorEvent, ThreadLifecycle, body_json, envelope_json
from holdfast_shared.ids import created_ms, new_id, new_task_id
from holdfast_shared.jobs import TurnJob
from holdfast_shared.observability import tracing
from holdfast_shared.observability.scopes import traced
from holdfast_shared.turnqueue import queue_turn
from redis.exceptions import ResponseError
from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway.errors import ApiError
from holdfast_gateway.forks import ForkRequest, fork_for_turn
from holdfast_gateway.limits import check_new_turn
from holdfast_gateway.state import GatewayState
from holdfast_gateway.storagequota import check_storage
from holdfast_gateway.tasks import TaskRef, lock_task

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StartedTurn:
    task: TaskRef
    turn_id: str
    started: LoggedEvent


async def _get_or_create_task(
    session: AsyncSession, tenant_id: str, name: str, agent: str | None, model: str | None
) -> tuple[TaskRef, bool]:
    """The tenant's task called ``name``, created (True) by this transaction
    when the tenant has none, its row locked until the transaction ends (a
    delete waits for the turn to be committed, then sees it and refuses).
    Names are per tenant: another tenant's task of the same name is neither
    seen nor touched."""
    for _ in range(_CREATE_ATTEMPTS):
        created = await session.scalar(
            insert(Task)
            .values(id=new_task_id(), tenant_id=tenant_id, name=name, agent=agent, model=model)
            .on_conflict_do_nothing(constraint="uq_tasks_tenant_id_name")
            .returning(Task.id)
        )
        if created is not None:
            return TaskRef(created, name), True
        found = await lock_task(session, tenant_id, name)
        if found is not None:
            return found, False
        # Deleted between the insert and the lock: the name is free again, and
        # this message starts a new task of that name.
    raise ApiError(
        409,
        ErrorCode.TURN_IN_PROGRESS,
        f"task {name!r} is being deleted and created again; send the message again",
        {"task_id": name},
    )


# Rounds of create-or-lock before giving up: each lost round means another
# request deleted the task meanwhile, so more than one is already rare.
_CREATE_ATTEMPTS = 3


# A lock whose turn was never committed is abandoned once it is this old: its
# gateway died between taking the lock and committing the turn.
_ABANDONED_AFTER_MS = 10_000


async def _take_abandoned_lock(state: GatewayState, task_id: str, turn_id: str) -> bool:
    """Take over a lock left by a gateway that died mid-request (no turn row)."""
    holder = await state.lock.holder(task_id)
    if holder is None:
        return await state.lock.acquire(task_id, turn_id)
    minted = created_ms(holder)
    if minted is None or time.time() * 1000 - minted < _ABANDONED_AFTER_MS:
        return False
    async with state.sessions() as session:
        if await session.get(Turn, holder) is not None:
            return False
    return await state.lock.replace(task_id, holder, turn_id)


async def _refuse_busy(state: GatewayState, task: TaskRef) -> NoReturn:
    running = await state.lock.holder(task.id)
    async with state.sessions() as session:
        waiting = await session.scalar(
            select(HitlRequestRecord.request_id)
            .where(HitlRequestRecord.task_id == task.id, HitlRequestRecord.status == "pending")
            .limit(1)
        )
    if waiting is not None:
        raise ApiError(
            409,
            ErrorCode.HITL_REQUIRED,
            f"task {task.name!r} waits for an answer to {waiting}; POST /hitl/respond first",
            {"task_id": task.name, "turn_id": running, "request_id": waiting},
        )
    raise ApiError(
        409,
        ErrorCode.TURN_IN_PROGRESS,
        f"task {task.name!r} already has a running turn; replay it or wait for it to end",
        {"task_id": task.name, "turn_id": running},
    )


@traced("holdfast.turn.start")
async def start_turn(
    state: GatewayState,
    tenant_id: str,
    *,
    message: str | None,
    task_id: str | None,
    agent: str | None,
    model: str | None,
    media: list[dict[str, Any]],
    user_id: str = "",
    fork: ForkRequest | None = None,
    also: Callable[[AsyncSession, TaskRef, str], Awaitable[None]] | None = None,
    claim: Callable[[AsyncSession, TaskRef, str], Awaitable[None]] | None = None,
    webhook: dict[str, Any] | None = None,
    output_schema: dict[str, Any] | None = None,
) -> StartedTurn:
    """Start a turn of the tenant's task named ``task_id`` (a new task when
    absent or new to the tenant).

    With ``fork`` (edit or retry, see ``forks.py``) the task must exist (404
    ``TASK_NOT_FOUND``), the conversation forks in the same transaction, and
    ``message`` is the edited text (None for a retry, which opens with the
    retried message's content).

    ``also(session, task, turn_id)`` writes what else must commit with the
    turn (an execution's row), in its transaction, before the job is queued;
    ``claim`` likewise, but first, before the task's lock is taken (the
    message's Idempotency-Key: ``executekeys.py``).

    ``output_schema``: the JSON Schema the turn's answer must meet, already
    checked (``outputschema.checked``); stored on the turn's row, where the
    loop-worker reads it.

    ``webhook``: the turn's subscription (``webhooks.accepted``; None: the
    tenant's default, if any, at each event)."""
    # 507 before anything is written; a turn accepted is never cut short by it.
    await check_storage(state, tenant_id)
    name = task_id or new_id("task")
    turn_id = new_id("turn")
    task: TaskRef | None = None
    locked = False
    committed = False
    appended = None
    try:
        # One transaction: a refused request (404, 409) rolls back even the
        # task it would have created, and an accepted message is committed
        # before anything is queued.
        async with state.sessions.begin() as session:
            task, new_task = await _get_or_create_task(session, tenant_id, name, agent, model)
            if fork is not None and new_task:
                # Rolled back with the transaction: nothing of it is kept.
                raise ApiError(
                    404, ErrorCode.TASK_NOT_FOUND, f"task {name!r} not found", {"task_id": name}
                )
            if claim is not None:
                # First, before the task's lock: a request racing with the same
                # claim (an Idempotency-Key) waits here for this one's outcome.
                await claim(session, task, turn_id)
            if not await state.lock.acquire(task.id, turn_id) and not await _take_abandoned_lock(
                state, task.id, turn_id
            ):
                await _refuse_busy(state, task)
            locked = True
            # The turn's first epoch: the stale-turn sweep moves it on before it
            # judges a turn never announced, so a gateway that stalls past that
            # judgement finds its ``started`` refused instead of announcing a
            # turn the sweep removed (recovery._remove_unaccepted).
            epoch = await next_epoch(state.redis, state.keys, task.id)
            # The tenant's running turns limit (429): after the busy check, so a message
            # for a busy task is told so (or waits, on_busy), and before the turn is
            # written; the lock is released and the transaction rolled back below.
            await check_new_turn(session, state.settings, tenant_id)
            forked = None if fork is None else await fork_for_turn(session, task.id, fork)
            if forked is not None and forked.content is not None:
                content = forked.content
            elif message is not None:
                content = user_content(message, media)
            else:
                raise ValueError("a turn opens with a message unless it retries one")
            # The task's last activity: GET /tasks lists the newest first.
            await session.execute(
                update(Task).where(Task.id == task.id).values(updated_at=func.now())
            )
            await session.execute(
                insert(Turn).values(
                    id=turn_id,
                    task_id=task.id,
                    status="queued",
                    agent=agent,
                    model=model,
                    user_id=user_id,
                    # Left out when None: SQL NULL (the tenant's default), not JSON null.
                    **({"webhook": webhook} if webhook is not None else {}),
                    **({"output_schema": output_schema} if output_schema is not None else {}),
                )
            )
            await session.execute(
                insert(Message).values(
                    task_id=task.id,
                    turn_id=turn_id,
                    position=0,
                    role="user",
                    content=content,
                )
            )
            if also is not None:
                await also(session, task, turn_id)
        committed = True
        started = ThreadLifecycle(
            phase="started",
            fork_id=forked.fork_id if forked else None,
            fork_reason=forked.reason if forked else None,
            fork_from_turn_id=forked.from_turn_id if forked else None,
        )
        body = body_json(started)
        appended = await state.eventlog.append_bodies(
            task.id, turn_id, [(started.type, body)], name=name, new_task=new_task, epoch=epoch
        )
        job = TurnJob(
            task_id=task.id,
            turn_id=turn_id,
            tenant_id=tenant_id,
            agent=agent,
            model=model,
            traceparent=tracing.turn_traceparent(task.id, turn_id),
        )
        await queue_turn(state.redis, state.keys, job)
    except BaseException as exc:
        if not locked or task is None:
            raise
        if committed and not isinstance(exc, (ResponseError, Superseded)):
            # Whether the ``started`` event or the job reached Redis is unknown: a
            # timeout or a dropped connection can follow a command that ran (a
            # stalled Redis runs it when it wakes), and a cancelled request stops
            # waiting for one that may still land. Taking the turn back left a
            # ``started`` that nothing ends; logging ``errored`` left a turn whose
            # job then ran. So the turn is left as a gateway that died here leaves
            # it, holding the task: the stale-turn sweep runs it if its ``started``
            # was logged and removes it (freeing the task) if not.
            log.warning("turn %s: start outcome unknown (%r); left to the sweep", turn_id, exc)
            raise
        if appended is None:
            # Never announced: take the turn back entirely, so the client's
            # retry is the only run of this message.
            with contextlib.suppress(Exception):
                async with state.sessions.begin() as session:
                    await session.execute(delete(Turn).where(Turn.id == turn_id))
        else:
            # The client may already replay this turn: end it visibly.
            with contextlib.suppress(Exception):
                await state.eventlog.append(
                    task.id,
                    turn_id,
                    [
                        ErrorEvent(
                            error=ErrorCode.INTERNAL, message="the turn could not be queued"
                        ),
                        ThreadLifecycle(phase="errored"),
                    ],
                    name=name,
                )
        with contextlib.suppress(Exception):
            await state.lock.release(task.id, turn_id)
        if isinstance(exc, Superseded):
            # Refused, so nothing of the turn reached Redis: this gateway stalled
            # past the sweep's judgement, which took the turn back (or is about to).
            raise ApiError(
                503,
                ErrorCode.UNAVAILABLE,
                "the turn was not started (this gateway stalled while starting it); retry",
                headers={"Retry-After": "1"},
            ) from None
        raise
    data = envelope_json(name, turn_id, appended.first_seq, appended.timestamps[0], body)
    return StartedTurn(task, turn_id, LoggedEvent(appended.first_seq, started.type, data))
