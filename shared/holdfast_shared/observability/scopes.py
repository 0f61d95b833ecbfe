"""Where a request, a turn or a tool call is handled: its span, its log context, its metrics.

Each service calls one of these at the place the work starts, so the hooks
in service code stay one line each and the logic lives here.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from opentelemetry.trace import SpanKind, Status, StatusCode

from holdfast_shared.jobs import ToolCallJob, ToolOutcome, TurnJob
from holdfast_shared.logs import bind_turn
from holdfast_shared.observability import metrics, tracing

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def traced(name: str) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Run the decorated coroutine function in a span named ``name`` (the gateway's
    start of a turn, inside FastAPI's own ``POST /execute`` server span): what it
    queues carries this span's context, so the turn continues this trace."""

    def decorate(handler: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(handler)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if not tracing.enabled():
                return await handler(*args, **kwargs)
            with tracing.span(name):
                return await handler(*args, **kwargs)

        return wrapper

    return decorate


async def observed_turn(job: TurnJob, run: Callable[[], Awaitable[str]]) -> str:
    """Run one turn job (``run`` returns its outcome): logs carry its ids, its span
    continues the trace of the request that queued it, its outcome is counted."""
    attributes = {
        "holdfast.task_id": job.task_id,
        "holdfast.turn_id": job.turn_id,
        "holdfast.resume": job.resume,
    }
    # Each turn job runs in an asyncio task of its own (consumer.py): the ids
    # stay bound for the worker's closing log line of the turn as well.
    bind_turn(job.task_id, job.turn_id)
    with tracing.span(
        "holdfast.turn",
        kind=SpanKind.CONSUMER,
        traceparent=job.traceparent,
        attributes=attributes,
    ) as current:
        try:
            outcome = await run()
        except asyncio.CancelledError:
            raise
        except Exception:
            metrics.TURN_RUNS.labels("failed").inc()
            raise
        metrics.TURN_RUNS.labels(outcome).inc()
        if current is not None:
            current.set_attribute("holdfast.outcome", outcome)
            if outcome == "errored":
                current.set_status(Status(StatusCode.ERROR, "the turn ended with an error"))
        return outcome


def observed_tool_call(
    handle: Callable[[S, ToolCallJob], Awaitable[ToolOutcome]],
) -> Callable[[S, ToolCallJob], Awaitable[ToolOutcome]]:
    """Decorates a runner's handling of one call: its logs carry the turn's ids, and
    its span (GenAI ``execute_tool``) is a child of the turn that asked for it."""

    @functools.wraps(handle)
    async def wrapper(self: S, job: ToolCallJob) -> ToolOutcome:
        tool = metrics.tool_label(job.tool, server=job.server)
        attributes = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": job.tool,
            "gen_ai.tool.call.id": job.tool_call_id,
            "holdfast.task_id": job.task_id,
            "holdfast.turn_id": job.turn_id,
        }
        # One asyncio task per call (the runner's consumer.py), as for turns.
        bind_turn(job.task_id, job.turn_id)
        with tracing.span(
            f"execute_tool {tool}",
            kind=SpanKind.CONSUMER,
            traceparent=job.traceparent,
            attributes=attributes,
        ) as current:
            outcome = await handle(self, job)
            if current is not None and outcome.error is not None:
                current.set_status(Status(StatusCode.ERROR, outcome.error[:200]))
            return outcome

    return wrapper


def timed_tool_run(
    run: Callable[[S, ToolCallJob], Awaitable[ToolOutcome]],
) -> Callable[[S, ToolCallJob], Awaitable[ToolOutcome]]:
    """Decorates the actual execution of a call: its latency, by tool and outcome."""

    @functools.wraps(run)
    async def wrapper(self: S, job: ToolCallJob) -> ToolOutcome:
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await run(self, job)
            outcome = "ok" if result.error is None else "error"
            return result
        finally:
            metrics.TOOL_SECONDS.labels(
                metrics.tool_label(job.tool, server=job.server), outcome
            ).observe(time.perf_counter() - started)

    return wrapper
