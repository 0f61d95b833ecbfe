"""The bench's phases, one module each, and the order they run in.

Each phase module has a docstring whose first paragraph says what it
measures (``--help`` shows it) and one entry point,
``run(ctx: Context) -> list[Row]``: it brings up the loop-workers it needs,
measures, and returns its rows; a measurement that fails becomes an ERROR row
and the phase goes on. Phases hand results on through the context only: the
raw baselines (``ctx.raw1``, ``ctx.raw_n``) and the shared instrumented
workers.
"""

from __future__ import annotations

from typing import Protocol

from bench.context import Context
from bench.phases import (
    capacity,
    console,
    context,
    e2e,
    executions,
    idle,
    latency,
    mcp,
    memory,
    providers,
    raw,
    recovery,
    scale,
    schedules,
    sdk,
    subagents,
    tools,
    typescript,
    workspaces,
)
from bench.table import Row


class Phase(Protocol):
    __doc__: str | None

    def run(self, ctx: Context) -> list[Row]: ...


# In the table's order.
PHASES: dict[str, Phase] = {
    "raw": raw,
    "e2e": e2e,
    "sdk": sdk,
    "typescript": typescript,
    "console": console,
    "latency": latency,
    "idle": idle,
    "scale": scale,
    "capacity": capacity,
    "providers": providers,
    "tools": tools,
    "mcp": mcp,
    "recovery": recovery,
    "context": context,
    "memory": memory,
    "workspaces": workspaces,
    "executions": executions,
    "schedules": schedules,
    "subagents": subagents,
}
# The order they run in: the raw baseline before any engine process starts;
# idle last whatever is asked, since it leaves 1,000 endless turns on its worker.
RUN_ORDER = (
    "raw",
    "context",
    "latency",
    "e2e",
    "sdk",
    "typescript",
    "console",
    "providers",
    "tools",
    "mcp",
    "recovery",
    "memory",
    "workspaces",
    "executions",
    "schedules",
    "subagents",
    "scale",
    "capacity",
    "idle",
)
# Every phase but raw, context and workspaces (in process) needs the gateway.
ENGINE_PHASES = frozenset(PHASES) - {"raw", "context", "workspaces"}


def summary(name: str) -> str:
    """The first paragraph of the phase's docstring, on one line."""
    doc = PHASES[name].__doc__ or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def run(ctx: Context, selected: set[str]) -> dict[str, list[Row]]:
    """Run the ``selected`` phases in :data:`RUN_ORDER` inside one engine session;
    their rows by phase."""
    rows: dict[str, list[Row]] = {}
    with ctx.session():
        for name in RUN_ORDER:
            if name not in selected:
                continue
            if name in ENGINE_PHASES and ctx.engine.gateway is None:
                ctx.engine.start_gateway()
            rows[name] = PHASES[name].run(ctx)
    return rows
