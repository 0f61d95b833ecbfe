"""Idle SSE connections (10,000 by default, on 1,000 quiet turns): gateway RSS per
connection and heartbeat gaps. Always runs last: it leaves the quiet turns running on its worker.

See ``bench.scenarios.idle_connections``.
"""

from __future__ import annotations

import math

from bench import harness, idle_raw, scenarios
from bench.context import Context, run_async
from bench.table import Row

TARGET_KB = 20.0
# Above this many connections the bench holds them with bench.idle_raw.
RAW_CLIENT_ABOVE = 1000


def run(ctx: Context) -> list[Row]:
    s, engine = ctx.sizes, ctx.engine
    rows: list[Row] = []
    label = f"{s.idle_connections:,} idle SSE"
    ctx.set_workers(1, ctx.options.idle_worker_concurrency)
    ctx.pause("idle")
    assert engine.gateway is not None
    ctx.say(
        f"idle: {s.idle_tasks:,} quiet turns, {s.idle_connections:,} replay streams, "
        f"hold {s.idle_hold:g} s"
    )
    idle = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
        # httpx streams cost the client far more than the gateway past a
        # thousand or so; the raw-socket client holds ten thousand cheaply.
        hold = (
            idle_raw.idle_connections_raw
            if s.idle_connections > RAW_CLIENT_ABOVE
            else scenarios.idle_connections
        )
        idle = run_async(
            lambda: hold(
                engine.gateway_url,
                engine.api_key,
                engine.gateway.pid,  # type: ignore[union-attr]
                connections=s.idle_connections,
                tasks=s.idle_tasks,
                hold_seconds=s.idle_hold,
                heartbeat_seconds=ctx.options.heartbeat,
            ),
            ctx.use_uvloop,
        )
    if idle is None:
        return rows
    kb = idle.kb_per_connection
    mb = 1024 * 1024
    worker_rss = sum(harness.rss(p.pid) for p in engine.workers)
    rows.append(
        Row(
            f"{label}: gateway RSS per connection",
            f"{kb:.1f} KB",
            target=f"≤ {TARGET_KB:.0f} KB",
            detail=f"gateway RSS {idle.rss_before / mb:.1f} MB → {idle.rss_open / mb:.1f} MB "
            f"(all open) → {idle.rss_end / mb:.1f} MB (after {s.idle_hold:g} s), larger "
            f"used. GET /execute/replay on {idle.tasks:,} quietly running turns "
            f"(created in {idle.create_seconds:.1f} s), opened in "
            f"{idle.open_seconds:.1f} s; gateway CPU while idle "
            f"{idle.gateway_cpu_pct:.0f}%; the worker holds the {idle.tasks:,} quiet turns in "
            f"{worker_rss / mb:.0f} MB RSS; client "
            f"{'raw sockets' if s.idle_connections > RAW_CLIENT_ABOVE else 'httpx'}. "
            f"CPU over the phase: {cpu.summary()}. {pg.summary()}",
            ok=kb <= TARGET_KB,
        )
    )
    gaps, hb = idle.gaps, idle.heartbeat_seconds
    pct = scenarios.percentile
    rows.append(
        Row(
            f"{label}: heartbeat gaps",
            (
                f"p50 {pct(gaps, 50):.2f} s\np99 {pct(gaps, 99):.2f} s\nmax {max(gaps):.2f} s"
                if gaps
                else "none"
            ),
            target=f"{hb:g} s interval, every gap ≤ {hb + 1:g} s",
            detail=f"{len(gaps):,} gaps between heartbeats as received, {idle.late} late; "
            f"gaps of the server's own timestamps p99 {pct(idle.server_gaps, 99):.2f} s, "
            f"max {max(idle.server_gaps, default=math.nan):.2f} s; streams ended early: "
            f"{idle.ended_early} ({idle.failed} with an error)",
            ok=bool(gaps) and idle.late == 0 and idle.ended_early == 0,
        )
    )
    return rows
