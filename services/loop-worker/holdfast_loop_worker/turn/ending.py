"""How a turn ends: its terminal events, then the record of its end (SQL in ``rows.py``).

A run that raised is mapped to one :data:`Outcome` (``run.py``); every
ending goes through :func:`end`: ``completed`` (with its stop reason),
``cancelled`` (``completed`` on the wire, ``stop_reason: "cancelled"``) or
``errored`` (an ``error`` event with a stable code first). The turn's
``usage`` total precedes its terminal event unless the last one sent says it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from holdfast_shared.errors import ErrorCode, HoldfastError
from holdfast_shared.events import ErrorEvent, ThreadLifecycle, Usage
from holdfast_shared.observability import metrics

import holdfast_loop_worker.turn.result as result
from holdfast_loop_worker.transient import store_refused, store_unreachable
from holdfast_loop_worker.turn.handle import EndingTurn, TurnHandle

log = logging.getLogger(__name__)

# How a run that stopped ends (the conductor's table, run.py, picks one).


@dataclass(frozen=True, slots=True)
class Fail:
    code: str
    message: str
    details: dict[str, Any] | None = None
    # A deadline cut a model call: its open blocks are closed first.
    close_blocks: bool = False
    # A model call broke after output reached the client: its partial message.
    store: dict[str, Any] | None = None

    @classmethod
    def of(cls, error: HoldfastError, *, store: dict[str, Any] | None = None) -> Fail:
        return cls(error.code, error.message, error.details, store=store)


@dataclass(frozen=True, slots=True)
class Cancel:
    """``POST /execute/cancel``: what the model had said is kept."""


@dataclass(frozen=True, slots=True)
class Park:
    request_id: str


@dataclass(frozen=True, slots=True)
class Pause:
    # A model call was cut off (its partial output is named on resume).
    cut: bool


@dataclass(frozen=True, slots=True)
class HandBack:
    """Shutdown: another worker continues the turn."""


@dataclass(frozen=True, slots=True)
class Reraise:
    """Not the turn's to end: the consumer decides (left pending, or stopped)."""


Outcome = Fail | Cancel | Park | Pause | HandBack | Reraise


async def completed(turn: EndingTurn, stop_reason: str) -> str:
    last = ThreadLifecycle(phase="completed", stop_reason=stop_reason)
    # An output schema's validated answer comes just before the end (result.py).
    answer = result.events(turn)
    await end(turn, "completed", stop_reason, [*final_usage(turn), *answer, last])
    return "completed"


async def cancelled(turn: EndingTurn) -> str:
    last = ThreadLifecycle(phase="completed", stop_reason="cancelled")
    await end(turn, "cancelled", "cancelled", [*final_usage(turn), last])
    return "cancelled"


async def failed(
    turn: EndingTurn, code: str, message: str, details: dict[str, Any] | None = None
) -> str:
    error = ErrorEvent(error=code, message=message, details=details)
    await end(turn, "errored", None, [*final_usage(turn), error, ThreadLifecycle(phase="errored")])
    return "errored"


async def state_expired(turn: EndingTurn) -> str:
    """Its channel state outlived its TTL: the turn cannot go on, and a client
    replaying it learns so from the error."""
    message = "the turn's saved state expired before it could continue; send the message again"
    return await failed(turn, ErrorCode.CHANNEL_STATE_EXPIRED, message)


async def already_ended(turn: EndingTurn) -> str:
    """A turn resumed after its terminal event was logged: only its end is recorded."""
    status = turn.seen.terminal_status
    await end(turn, status, turn.seen.terminal_stop_reason, [])
    return status


async def end(turn: EndingTurn, status: str, stop_reason: str | None, last: list[Any]) -> None:
    """Log the terminal events and free the task (one atomic step), then record it.

    A turn resumed after its terminal event was logged (the worker died
    just after) only records the end: the events are not logged twice.
    """
    error = next((e for e in last if isinstance(e, ErrorEvent)), None)
    ending = turn.ending(
        status, stop_reason, {"code": error.error, "message": error.message} if error else None
    )
    # Counted before the terminal event: a client that saw it finds it counted.
    metrics.turn_ended(ending)
    if turn.seen.terminal:
        await turn.release_task()
    else:
        await turn.finish_events(last)
    await turn.record_end(ending)
    # Nothing waits for its subagents any more (a cancel, a deadline, a failure).
    await turn.stop_children()
    await turn.end_execution(status, last)
    # The task is free: a message that waited for this turn starts now.
    await turn.start_following()


def final_usage(turn: TurnHandle) -> list[Usage]:
    """The turn's total before its terminal event, unless the last ``usage``
    this worker sent (after the last model call) says it already."""
    if turn.reported_usage == turn.state.usage:
        return []
    return [usage_so_far(turn, record=True)]


# In the turn's usage counts: its model calls counted from the engine's own
# estimates (no usage reported, or an implausible one: model_step.py).
ESTIMATED_CALLS = "estimated_calls"


def usage_so_far(turn: TurnHandle, *, record: bool = False) -> Usage:
    """``usage`` so far in the turn: cumulative over its model calls."""
    u = turn.state.usage
    if record:
        turn.reported_usage = dict(u)
    return Usage(
        input_tokens=u.get("input_tokens", 0),
        output_tokens=u.get("output_tokens", 0),
        cache_creation_input_tokens=u.get("cache_creation_input_tokens", 0),
        cache_read_input_tokens=u.get("cache_read_input_tokens", 0),
        reasoning_tokens=u.get("reasoning_tokens", 0),
        model=turn.model_label,
        active_seconds=turn.active_ms() / 1000,
        estimated=True if u.get(ESTIMATED_CALLS) else None,
        subagents=dict(turn.state.subagent_usage) or None,
    )


def unexpected(exc: Exception, turn: TurnHandle) -> Fail | Reraise:
    """How a run that raised something no step expected ends."""
    store = store_unreachable(exc)
    if store is not None:
        # Redis or PostgreSQL restarting (transient.py): not a reason to end the
        # user's turn. The turn is left as a crash leaves it: the consumer keeps
        # its job pending and gives up its lease (or it lapses), and it resumes
        # from its last snapshot once the store answers (what it emitted since
        # is named by turn_resumed).
        log.warning(
            "turn %s stopped by an unreachable %s (%s); it resumes once %s answers",
            turn.job.turn_id,
            store,
            type(exc).__name__,
            store,
        )
        return Reraise()
    if (sqlstate := store_refused(exc)) is not None:
        # A full disk (or the like) refused the turn's writes: its end says so,
        # and the task takes the next message once PostgreSQL accepts writes.
        log.error("turn %s: PostgreSQL refused its writes: %s", turn.job.turn_id, exc)
        message = f"PostgreSQL refused the turn's writes (SQLSTATE {sqlstate}); send it again later"
        return Fail(ErrorCode.UNAVAILABLE, message, {"store": "PostgreSQL", "sqlstate": sqlstate})
    log.error("turn %s failed", turn.job.turn_id, exc_info=exc)
    return Fail(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
