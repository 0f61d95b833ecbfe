"""text_delta throughput through gateway SSE (1 task; N concurrent tasks; 1 and 2
loop-workers) against the raw baselines, and the client parser's own speed.

See ``bench.scenarios`` (single_task, concurrent_tasks) and ``bench.sse.parse_rate``.
"""

from __future__ import annotations

from bench import harness, scenarios
from bench.context import Context, run_async
from bench.table import Row, fmt_rate

TARGET_RATIO = 0.3
# The client parser must be at least this many times faster than the fastest
# engine row for the client not to matter.
CLIENT_HEADROOM = 10.0


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    recorded: list[bytes] = []  # the chunks of the first 1-task run, as they arrived
    rates: list[float] = []  # steady deltas/s of every throughput row so far
    ctx.set_workers(1, ctx.workers_for(1))
    ctx.pause("e2e")
    rows += _throughput_rows(ctx, 1, recorded, rates)
    if recorded:
        rate, frames = scenarios.client_parse_rate(recorded)
        headroom = rate / max(rates)
        rows.append(
            Row(
                "SSE client parser, recorded stream re-fed in memory",
                f"{rate:,.0f} frames/s",
                "",
                f"{headroom:.0f}x engine",
                f"≥ {CLIENT_HEADROOM:.0f}x fastest E2E row",
                f"the {frames:,} frames of the 1-task run, as the {len(recorded):,} chunks "
                "they arrived in; so the client is "
                + (
                    "not the bottleneck"
                    if headroom >= CLIENT_HEADROOM
                    else "POSSIBLY the bottleneck"
                ),
                ok=headroom >= CLIENT_HEADROOM,
            )
        )
    if ctx.options.two_workers:
        ctx.set_workers(2, ctx.workers_for(2))
        rows += _throughput_rows(ctx, 2, recorded, rates)
    return rows


def _throughput_rows(
    ctx: Context, workers: int, recorded: list[bytes], rates: list[float]
) -> list[Row]:
    s = ctx.sizes
    url, key = ctx.engine.gateway_url, ctx.engine.api_key
    rows: list[Row] = []
    suffix = f"{workers} worker" + ("s" if workers > 1 else "")
    label = f"E2E text_delta via SSE, 1 task x {s.single_deltas:,}, {suffix}"
    ctx.say(label)
    one = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
        one = run_async(lambda: scenarios.single_task(url, key, s.single_deltas), ctx.use_uvloop)
    if one is not None:
        if not recorded:
            recorded.extend(one.recorded)
        rates.append(one.steady)
        rows.append(_ratio_row(label, one, ctx.raw1, ctx.raw1_pipelined, cpu, pg))
    label = f"E2E text_delta via SSE, {s.tasks} tasks x {s.task_deltas:,}, {suffix}"
    ctx.say(label)
    many = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
        many = run_async(
            lambda: scenarios.concurrent_tasks(url, key, s.tasks, s.task_deltas),
            ctx.use_uvloop,
        )
    if many is not None:
        rates.append(many.steady)
        rows.append(_ratio_row(label, many, ctx.raw_n, ctx.raw_n_pipelined, cpu, pg))
    return rows


def _ratio_row(
    label: str,
    t: scenarios.Throughput,
    base: float | None,
    pipelined: float | None,
    cpu: harness.CpuMeter,
    pg: harness.PgConnections,
) -> Row:
    ratio = t.from_post / base if base else None
    # The target is against the awaited baseline; the pipelined one (the most
    # Redis takes) is shown beside it.
    base_cell = fmt_rate(base) if base else "n/a"
    ratio_cell = f"{ratio:.2f}" if ratio is not None else "n/a"
    if pipelined:
        base_cell += f"\npipelined {fmt_rate(pipelined)}"
        ratio_cell += f"\n{t.from_post / pipelined:.2f}"
    return Row(
        label,
        f"{fmt_rate(t.from_post)}\n(steady {fmt_rate(t.steady)})",
        base_cell,
        ratio_cell,
        f"≥ {TARGET_RATIO}",
        f"POST sent → last delta received (steady: first → last delta); "
        f"{t.total:,} deltas in {t.chunks:,} HTTP chunks, {t.wall:.2f} s. "
        f"CPU: {cpu.summary()}. {pg.summary()}",
        ok=None if ratio is None else ratio >= TARGET_RATIO,
    )
