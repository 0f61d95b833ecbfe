"""Every Prometheus metric of the engine, defined once, and the helpers that move them.

Each process exports what it does itself: the gateway on its own ``/metrics``
route, a loop-worker, tool-runner or learning process on
``HOLDFAST_METRICS_PORT`` (:func:`serve_metrics`). A series is therefore per
process; Prometheus adds the ``instance`` label, and sums across them.
What is not any one process's (the job streams, the turns waiting for an
answer) the gateway reads on scrape (``holdfast_gateway/queuegauges.py``).

Labels are bounded: agents, models and tools are labels, task, turn or
tenant ids never are. Agents and models can be named by tenants and
requests, so each of those labels keeps its first :data:`LABEL_VALUES_KEPT`
values and reports any later one as ``other``; a tool of a tenant's MCP server
is ``mcp``. docs/operations.md lists every series.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

LABEL_VALUES_KEPT = 100
OTHER = "other"

# -- turns (loop-worker) ---------------------------------------------------------
TURNS_STARTED = Counter(
    "holdfast_turns_started",
    "Turns that began their first run (not a resumption), by agent and model.",
    ["agent", "model"],
)
TURNS_COMPLETED = Counter(
    "holdfast_turns_completed",
    "Turns that ended completed (any stop reason but cancelled), by agent and model.",
    ["agent", "model"],
)
TURNS_ERRORED = Counter(
    "holdfast_turns_errored",
    "Turns that ended with an error, by agent and model.",
    ["agent", "model"],
)
TURNS_CANCELLED = Counter(
    "holdfast_turns_cancelled",
    "Turns cancelled by a client, by agent and model.",
    ["agent", "model"],
)
TURN_ACTIVE_SECONDS = Histogram(
    "holdfast_turn_active_seconds",
    "Time a turn spent running (parked time excluded), at its end, by agent and model.",
    ["agent", "model"],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600),
)
TURN_RUNS = Counter(
    "holdfast_turn_runs",
    "Runs of turn jobs by how they ended: completed, errored, cancelled, parked, "
    "handed_back, skipped, busy, superseded, failed (an exception; the job is retried).",
    ["outcome"],
)
LEASE_TAKEOVERS = Counter(
    "holdfast_lease_takeovers",
    "Turns this worker took over from a worker whose lease lapsed.",
)
TURNS_REQUEUED = Counter(
    "holdfast_turns_requeued",
    "Turns queued again from PostgreSQL: redis_lost (the turns group was gone) or stale.",
    ["reason"],
)

# -- model calls (loop-worker) ---------------------------------------------------
MODEL_TIME_TO_FIRST_TOKEN = Histogram(
    "holdfast_model_time_to_first_token_seconds",
    "From a model call's start to its first streamed output, by model (provider:model).",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60),
)
MODEL_CALL_SECONDS = Histogram(
    "holdfast_model_call_seconds",
    "Duration of model calls (retries included), by model and outcome (ok, error).",
    ["model", "outcome"],
    buckets=(0.1, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320),
)
MODEL_TOKENS = Counter(
    "holdfast_model_tokens",
    "Tokens reported by providers, by model and kind (input, output, cache_read, "
    "cache_creation, reasoning).",
    ["model", "kind"],
)

# -- event log (every process that appends) --------------------------------------
EVENTS_APPENDED = Counter(
    "holdfast_events_appended", "Events appended to task event logs, by event type.", ["type"]
)

# -- gateway -----------------------------------------------------------------------
SSE_CONNECTIONS = Gauge("holdfast_sse_connections", "Open SSE streams on this gateway.")
SSE_TASKS = Gauge("holdfast_sse_tasks", "Tasks whose event logs this gateway tails.")
STREAM_LENGTH = Gauge(
    "holdfast_stream_length", "Entries in a job stream (turns, tools, trajectories).", ["stream"]
)
STREAM_PENDING = Gauge(
    "holdfast_stream_pending",
    "Entries delivered to a consumer group and not acknowledged yet.",
    ["stream", "group"],
)
STREAM_LAG = Gauge(
    "holdfast_stream_lag", "Entries not yet delivered to a consumer group.", ["stream", "group"]
)
STREAM_OLDEST_PENDING = Gauge(
    "holdfast_stream_oldest_pending_seconds",
    "Age of the oldest unacknowledged entry of a consumer group (0 when none).",
    ["stream", "group"],
)
HITL_WAITING_TURNS = Gauge(
    "holdfast_hitl_waiting_turns", "Turns parked on a question to the user (pending requests)."
)

# -- tools (tool-runner) ---------------------------------------------------------
TOOL_SECONDS = Histogram(
    "holdfast_tool_seconds",
    "Tool execution time on a runner (a recalled outcome excluded), by tool and outcome "
    '(ok, error). Tools of MCP servers are tool="mcp".',
    ["tool", "outcome"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)

# -- learning ----------------------------------------------------------------------
LEARNING_LAG = Histogram(
    "holdfast_learning_lag_seconds",
    "From a turn's end to its trajectory being learned.",
    buckets=(0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400),
)
TRAJECTORIES = Counter(
    "holdfast_trajectories",
    "Trajectories the learning centre handled, by outcome (learned, failed, dead).",
    ["outcome"],
)


class _LabelCap:
    """Keeps the first ``limit`` values of a label; later ones become ``other``."""

    def __init__(self, limit: int = LABEL_VALUES_KEPT) -> None:
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str | None) -> str:
        value = value or "default"
        if value in self._seen:
            return value
        with self._lock:
            if len(self._seen) >= self.limit:
                return OTHER
            self._seen.add(value)
        return value


agent_label = _LabelCap()
model_label = _LabelCap()


def tool_label(tool: str, *, server: str | None) -> str:
    """A built-in tool's name; ``mcp`` for any tool of a tenant's MCP server."""
    return "mcp" if server is not None else tool


# -- recording helpers (one call at each instrumented site) -----------------------------
def turn_started(agent: str | None, model: str | None) -> None:
    TURNS_STARTED.labels(agent_label(agent), model_label(model)).inc()


class TurnEnd(Protocol):
    """What :func:`turn_ended` reads of a turn's ending (the loop-worker's ``TurnEnding``)."""

    @property
    def agent(self) -> str | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def status(self) -> str: ...
    @property
    def active_ms(self) -> int: ...


def turn_ended(end: TurnEnd) -> None:
    """A turn's end (``completed``, ``errored`` or ``cancelled``), once per turn."""
    labels = (agent_label(end.agent), model_label(end.model))
    counters = {"completed": TURNS_COMPLETED, "errored": TURNS_ERRORED}
    counters.get(end.status, TURNS_CANCELLED).labels(*labels).inc()
    TURN_ACTIVE_SECONDS.labels(*labels).observe(end.active_ms / 1000)


def lease_claimed(previous_owner: str | None, owner: str) -> None:
    """A claim of a turn's lease: a takeover when another worker held it last."""
    if previous_owner is not None and previous_owner != owner:
        LEASE_TAKEOVERS.inc()


def events_appended(bodies: Iterable[tuple[str, str]]) -> None:
    for event_type, _body in bodies:
        EVENTS_APPENDED.labels(event_type).inc()


def trajectory_learned(finished_at: datetime | None) -> None:
    TRAJECTORIES.labels("learned").inc()
    if finished_at is not None:
        LEARNING_LAG.observe(max(0.0, (datetime.now(UTC) - finished_at).total_seconds()))


def trajectory_failed(*, dead: bool) -> None:
    TRAJECTORIES.labels("dead" if dead else "failed").inc()


def serve_metrics(host: str, port: int | None) -> int | None:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread (off the event loop);
    the port, or None when ``port`` is 0/None or cannot be bound (logged: a worker
    runs on without metrics rather than not at all)."""
    if not port:
        return None
    try:
        start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as exc:
        log.warning("metrics not served: cannot listen on %s:%d: %s", host, port, exc)
        return None
    log.info("metrics on http://%s:%d/metrics", host, port)
    return port
