"""Sandboxed tool execution: its overhead over a bare exec, execs/s at a runner's
concurrency, and a bash tool call's round trip through a real tool-runner.

See ``bench.tools``.
"""

from __future__ import annotations

import os

from bench import scenarios, tools
from bench.context import Context, run_async
from bench.instrument import ENV as SPANS_ENV
from bench.instrument import RUNNER_CODE
from bench.table import Row

TARGET_SANDBOX_OVERHEAD_MS = 15.0
TARGET_TOOL_ROUND_TRIP_MS = 25.0


def run(ctx: Context) -> list[Row]:
    s, engine, pct = ctx.sizes, ctx.engine, scenarios.percentile
    rows: list[Row] = []
    # Under the log directory: mkdtemp made it 0700 and root-owned, which the
    # sandbox requires of a workspace's parent when it runs as root.
    workspaces = tools.make_workspaces(engine.log_dir / "sandbox", max(1, s.exec_concurrency))
    label = "Sandboxed exec overhead vs bare exec (`true`)"
    ctx.say(f"{label}: {s.sandbox_runs} pairs")
    sb = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, _pg):
        sb = run_async(
            lambda: tools.sandbox_overhead(
                workspaces[0], s.sandbox_runs, ctx.options.sandbox_gap_ms
            ),
            False,
        )
    if sb is not None:
        mech = ", ".join(f"{k} {v}" for k, v in sb.mechanisms.items())
        rows.append(
            Row(
                label,
                f"+{sb.overhead_p50:.1f} ms p50",
                f"{pct(sb.bare_ms, 50):.1f} ms bare",
                f"{sb.ratio:.1f}x",
                f"≤ {TARGET_SANDBOX_OVERHEAD_MS:g} ms p50",
                f"{s.sandbox_runs} alternating pairs in this process (stdlib asyncio, like the "
                f"tool-runner), each sandboxed call after {sb.gap_ms:g} ms idle like a tool "
                f"call, through a launcher pool of {sb.spares} spares as the tool-runner keeps: "
                f"run_sandboxed(['true']) p50 {pct(sb.sandboxed_ms, 50):.1f} ms, "
                f"p99 {pct(sb.sandboxed_ms, 99):.1f} ms; bare create_subprocess_exec('true') "
                f"p50 {pct(sb.bare_ms, 50):.1f} ms, p99 {pct(sb.bare_ms, 99):.1f} ms; sandboxed "
                f"`bash -c true` (what the bash tool runs) p50 "
                f"{pct(sb.sandboxed_bash_ms, 50):.1f} ms over {len(sb.sandboxed_bash_ms)} runs; "
                f"without a pool (the call spawns its launcher and waits for its move into the "
                f"call's cgroups) p50 {pct(sb.unpooled_ms, 50):.1f} ms over "
                f"{len(sb.unpooled_ms)} runs. Limits: {mech}. Machine CPU {cpu.machine:.0f}% of "
                f"{100 * (os.cpu_count() or 1)}%",
                ok=sb.overhead_p50 <= TARGET_SANDBOX_OVERHEAD_MS,
            )
        )
    label = f"Sandboxed execs/s, one runner's concurrency ({len(workspaces)})"
    ctx.say(f"{label}: {s.exec_seconds:g} s")
    rate = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, _pg):
        rate = run_async(lambda: tools.exec_rate(workspaces, s.exec_seconds), False)
    if rate is not None:
        rows.append(
            Row(
                label,
                f"{rate.rate:,.0f}/s",
                target="(none set)",
                detail=f"{rate.concurrency} coroutines calling run_sandboxed(['true']) back to "
                f"back for {s.exec_seconds:g} s in one process, one workspace each, one "
                f"launcher pool: "
                f"{rate.execs:,} execs, each p50 {pct(rate.latencies_ms, 50):.0f} ms, p99 "
                f"{pct(rate.latencies_ms, 99):.0f} ms. Machine CPU {cpu.machine:.0f}% of "
                f"{100 * (os.cpu_count() or 1)}%",
            )
        )
    rows += _tool_round_trip(ctx, sb)
    return rows


def _tool_round_trip(ctx: Context, sb: tools.SandboxOverhead | None) -> list[Row]:
    s, engine, pct = ctx.sizes, ctx.engine, scenarios.percentile
    rows: list[Row] = []
    label = "Tool round trip (loop-worker → tool-runner → result), beyond the exec"
    rt = None
    with ctx.errors_to(rows, label):
        spans, _server = ctx.instrumented(1)
        engine.start_tool_runner({SPANS_ENV: str(spans.directory)}, RUNNER_CODE)
        ctx.pause("tools")
        ctx.say(f"{label}: {s.tool_turns} sequential turns")
        with ctx.measured() as (cpu, pg):
            rt = run_async(
                lambda: tools.round_trips(engine.gateway_url, engine.api_key, s.tool_turns, spans),
                ctx.use_uvloop,
            )
    engine.stop_tool_runners()
    if rt is None:
        return rows
    if sb is not None and sb.sandboxed_bash_ms:
        exec_ms = pct(sb.sandboxed_bash_ms, 50)
        exec_note = "the sandboxed `bash -c true` p50 measured directly"
    else:
        exec_ms = pct(rt.segments_ms["sandbox"], 50)
        exec_note = "the runner's own sandboxed exec p50"
    overhead = rt.p50 - exec_ms
    steps = "; ".join(
        f"{name} {pct(rt.segments_ms[key], 50):.1f}"
        for name, key in tools.SEGMENTS
        if rt.segments_ms[key]
    )
    in_situ = ""
    if rt.segments_ms["sandbox"] and sb is not None:
        own = pct(rt.segments_ms["sandbox"], 50)
        in_situ = (
            f"; against the exec as timed inside the tool-runner ({own:.1f} ms) it is "
            f"{rt.p50 - own:.1f} ms"
        )
    inner = "; ".join(f"{name} {pct(v, 50):.1f}" for name, v in rt.steps_ms.items())
    rows.append(
        Row(
            label,
            f"{overhead:.1f} ms p50",
            f"{exec_ms:.1f} ms exec",
            "",
            f"≤ {TARGET_TOOL_ROUND_TRIP_MS:g} ms p50",
            f"tool_call frame → tool_result frame at the client, {s.tool_turns} sequential "
            f"turns after 5 warm-up, each on a new task with one bash `true` call: p50 "
            f"{rt.p50:.1f} ms, p99 {rt.p99:.1f} ms, minus {exec_note} ({exec_ms:.1f} ms)"
            f"{in_situ}. Step by step, p50 ms (instrumented worker and runner, one clock): "
            f"{steps}. Single steps inside them, p50 ms: {inner}. CPU: "
            f"{cpu.summary()}. {pg.summary()}",
            ok=overhead <= TARGET_TOOL_ROUND_TRIP_MS,
        )
    )
    return rows
