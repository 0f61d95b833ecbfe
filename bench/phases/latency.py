"""POST→started latency p50/p99: sequential POSTs, each on a new task, each read to its end.

See ``bench.scenarios.post_to_started``.
"""

from __future__ import annotations

from bench import scenarios
from bench.context import Context, run_async
from bench.table import Row

TARGET_P50_MS = 10.0
TARGET_P99_MS = 50.0


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    ctx.set_workers(1, ctx.workers_for(1))
    ctx.pause("latency")
    n = ctx.sizes.latency_posts
    label = "POST→started latency"
    ctx.say(f"{label}: {n} sequential POSTs")
    lat = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
        lat = run_async(
            lambda: scenarios.post_to_started(ctx.engine.gateway_url, ctx.engine.api_key, n),
            ctx.use_uvloop,
        )
    if lat is None:
        return rows
    rows.append(
        Row(
            f"{label} p50",
            f"{lat.p50:.1f} ms",
            target=f"≤ {TARGET_P50_MS:.0f} ms",
            detail=f"{n} sequential POSTs on new tasks after 10 warm-up; request sent → "
            "'started' frame parsed; each turn read to its end",
            ok=lat.p50 <= TARGET_P50_MS,
        )
    )
    rows.append(
        Row(
            f"{label} p99",
            f"{lat.p99:.1f} ms",
            target=f"≤ {TARGET_P99_MS:.0f} ms",
            detail=f"max {lat.max:.1f} ms. CPU: {cpu.summary()}. {pg.summary()}",
            ok=lat.p99 <= TARGET_P99_MS,
        )
    )
    return rows
