"""Holdfast performance bench: one table, every row measured in the same run.

    uv run --group dev python -m bench.run                  # full run (a few minutes on 2 cores)
    uv run --group dev python -m bench.run --quick          # smaller sizes, for a smoke run
    uv run --group dev python -m bench.run --phase latency  # one phase (repeatable)

This module holds the arguments and prints the table; the phases are in
``bench.phases`` (one module each, ``--help`` lists them), what they share
in ``bench.context``, and the table's row in ``bench.table``. Ratios divide
by the raw redis-py baseline measured in the same run. See
docs/performance.md.
"""

from __future__ import annotations

import argparse
import shutil
import textwrap
import time
from typing import Any

from rich.console import Console

from bench import phases
from bench.context import SMALL_CONCURRENCY, Context, Options, Sizes
from bench.phases.recovery import RECOVERY_WORKERS
from bench.table import render

CAPACITY_STEPS = "10,25,50,100,200,400,600,800,1000"

DESCRIPTION = (
    "Benchmark Holdfast end to end (a real gateway and loop-worker processes on the "
    "local Redis and PostgreSQL) against a raw redis-py XADD→XREAD baseline measured "
    "in the same run, and print one table with PASS/MISS against the targets. "
    "HOLDFAST_BENCH_REDIS_URL / HOLDFAST_BENCH_DATABASE_URL (an admin URL; a fresh "
    "database is created and dropped) override the local servers."
)


def _phases_help(width: int) -> str:
    lines = ["phases (in the table's order; they run raw first and idle last):"]
    for name in phases.PHASES:
        lines += textwrap.wrap(
            phases.summary(name),
            width=width,
            initial_indent=f"  {name:<10} ",
            subsequent_indent=" " * 13,
            break_on_hyphens=False,
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, with ``options`` (:class:`Options`) and ``selected`` (phase names)."""
    width = shutil.get_terminal_size().columns - 2  # as argparse wraps the options
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=textwrap.fill(DESCRIPTION, width=width),
        epilog=_phases_help(width),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smaller default sizes for a smoke run (sizes given explicitly win)",
    )
    g = p.add_argument_group("sizes (full default; --quick default)")
    g.add_argument("--raw-events", type=int, help="entries per raw baseline run [50000; 10000]")
    g.add_argument(
        "--raw-streams",
        type=int,
        default=100,
        help="streams (one producer each) of the concurrent raw baseline [100]",
    )
    g.add_argument("--single-deltas", type=int, help="deltas of the 1-task row [20000; 5000]")
    g.add_argument("--tasks", type=int, help="concurrent tasks (POSTs at once) [100; 50]")
    g.add_argument("--task-deltas", type=int, help="deltas per concurrent task [1000; 200]")
    g.add_argument("--latency-posts", type=int, help="sequential POSTs timed [300; 50]")
    g.add_argument("--idle-connections", type=int, help="idle SSE connections [10000; 200]")
    g.add_argument(
        "--idle-tasks",
        type=int,
        help="quietly running turns the idle connections follow, round robin "
        "[at most 1000; --quick: one task per connection]",
    )
    g.add_argument(
        "--idle-hold",
        type=float,
        help="seconds the idle connections are held while heartbeats are timed [20; 6]",
    )
    g.add_argument("--provider-turns", type=int, help="sequential provider turns timed [200; 50]")
    g.add_argument(
        "--provider-deltas", type=int, help="deltas of the provider throughput turn [20000; 5000]"
    )
    g.add_argument(
        "--sandbox-runs", type=int, help="sandboxed/bare exec pairs, alternating [200; 50]"
    )
    g.add_argument(
        "--exec-seconds", type=float, help="duration of the sandboxed execs/s run [5; 2]"
    )
    g.add_argument(
        "--exec-concurrency",
        type=int,
        default=8,
        help="concurrent sandboxed execs (the tool-runner's default HOLDFAST_TOOL_CONCURRENCY) [8]",
    )
    g.add_argument("--tool-turns", type=int, help="sequential bash tool turns timed [100; 30]")
    g.add_argument(
        "--snapshot-saves", type=int, help="Snapshots.save calls timed directly [500; 200]"
    )
    g.add_argument(
        "--snapshot-turns",
        type=int,
        help="short turns run for the per-iteration snapshot cost in workers [100; 30]",
    )
    g.add_argument(
        "--recovery-rounds",
        type=int,
        help="rounds of worker SIGKILLs, each ~13 s with the default lease [2; 1]",
    )
    g.add_argument(
        "--recovery-kills",
        type=int,
        default=2,
        help=f"workers SIGKILLed per round, of {RECOVERY_WORKERS} (at most "
        f"{RECOVERY_WORKERS - 1}) [2]",
    )
    g.add_argument(
        "--recovery-turns",
        type=int,
        help=f"slow turns running on the {RECOVERY_WORKERS} workers in each round [9; 6]",
    )
    g.add_argument(
        "--scale-turns",
        type=int,
        help="turns per loop-worker in the turns/s row (1 and 4 workers) [60; 30]",
    )
    g.add_argument(
        "--capacity-steps",
        help=f"comma-separated numbers of concurrent live turns (50 deltas/s each) tried "
        f"in order until the delta's p99 passes 100 ms [{CAPACITY_STEPS}; 10,25,50]",
    )
    g.add_argument(
        "--capacity-hold",
        type=float,
        help="seconds all of a step's turns stream at once, timed [8; 4]",
    )
    e = p.add_argument_group("engine")
    e.add_argument(
        "--heartbeat", type=float, default=2.0, help="HOLDFAST_HEARTBEAT_SECONDS of the gateway [2]"
    )
    e.add_argument(
        "--worker-concurrency",
        type=int,
        help="HOLDFAST_WORKER_CONCURRENCY of each loop-worker in the latency and "
        "throughput rows [--tasks ÷ number of workers, so every task runs at "
        "once and the worker's PostgreSQL pool stays within max_connections]",
    )
    e.add_argument(
        "--idle-worker-concurrency",
        type=int,
        default=1100,
        help="HOLDFAST_WORKER_CONCURRENCY of the loop-worker in the idle rows, "
        "which keeps one quiet turn running per task [1100]",
    )
    e.add_argument(
        "--no-two-workers",
        action="store_true",
        help="skip the throughput rows with two loop-workers",
    )
    e.add_argument(
        "--phase",
        action="append",
        choices=tuple(phases.PHASES),
        metavar="NAME",
        dest="phase",
        help="run this phase (repeatable; see the list below) [all]",
    )
    e.add_argument(
        "--phases",
        "--only",
        dest="phases",
        help=f"comma-separated phases, a subset of {','.join(phases.PHASES)} (the same as "
        "repeating --phase) [all]",
    )
    e.add_argument(
        "--no-uvloop",
        action="store_true",
        help="run the bench client and raw baseline on the stdlib asyncio loop "
        "(default: uvloop, like the gateway)",
    )
    e.add_argument(
        "--pause-before",
        choices=tuple(n for n in phases.RUN_ORDER if n != "raw"),
        help="print the engine pids and wait for Enter before that phase (to attach a profiler)",
    )
    e.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before starting, wait up to SECONDS for the machine to be quiet (under 25%% "
        "of one core busy over 2 s), for shared machines [0: don't wait]",
    )
    e.add_argument(
        "--sandbox-gap-ms",
        type=float,
        default=30.0,
        help="idle time before each timed sandboxed call, as between tool calls (see "
        "docs/performance.md: back-to-back cgroup moves are cheaper) [30]",
    )
    e.add_argument("--keep-logs", action="store_true", help="keep the engine's log directory")
    args = p.parse_args(argv)

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if args.quick else full)

    idle_connections = pick(args.idle_connections, 10_000, 200)
    sizes = Sizes(
        raw_events=pick(args.raw_events, 50_000, 10_000),
        raw_streams=args.raw_streams,
        single_deltas=pick(args.single_deltas, 20_000, 5_000),
        tasks=pick(args.tasks, 100, 50),
        task_deltas=pick(args.task_deltas, 1_000, 200),
        latency_posts=pick(args.latency_posts, 300, 50),
        idle_connections=idle_connections,
        idle_tasks=pick(args.idle_tasks, min(idle_connections, 1000), idle_connections),
        idle_hold=pick(args.idle_hold, 20.0, 6.0),
        provider_turns=pick(args.provider_turns, 200, 50),
        provider_deltas=pick(args.provider_deltas, 20_000, 5_000),
        sandbox_runs=pick(args.sandbox_runs, 200, 50),
        exec_seconds=pick(args.exec_seconds, 5.0, 2.0),
        exec_concurrency=args.exec_concurrency,
        tool_turns=pick(args.tool_turns, 100, 30),
        snapshot_saves=pick(args.snapshot_saves, 500, 200),
        snapshot_turns=pick(args.snapshot_turns, 100, 30),
        recovery_rounds=pick(args.recovery_rounds, 2, 1),
        recovery_kills=args.recovery_kills,
        recovery_turns=pick(args.recovery_turns, 9, 6),
        scale_turns=pick(args.scale_turns, 60, 30),
        capacity_steps=tuple(
            int(x) for x in pick(args.capacity_steps, CAPACITY_STEPS, "10,25,50").split(",")
        ),
        capacity_hold=pick(args.capacity_hold, 8.0, 4.0),
    )
    args.options = Options(
        sizes=sizes,
        heartbeat=args.heartbeat,
        worker_concurrency=args.worker_concurrency,
        idle_worker_concurrency=args.idle_worker_concurrency,
        two_workers=not args.no_two_workers,
        use_uvloop=not args.no_uvloop,
        pause_before=args.pause_before,
        wait_quiet=args.wait_quiet,
        sandbox_gap_ms=args.sandbox_gap_ms,
        keep_logs=args.keep_logs,
    )
    selected = set(args.phase or ())
    if args.phases is not None:
        selected |= {x.strip() for x in args.phases.split(",") if x.strip()}
    unknown = selected - set(phases.PHASES)
    if unknown:
        p.error(f"unknown phases: {', '.join(sorted(unknown))}")
    args.selected = selected or set(phases.PHASES)
    return args


def caption(ctx: Context, seconds: float) -> str:
    options = ctx.options
    return (
        f"All rows from one run ({seconds:.0f} s): 1 gateway, loop-workers as stated "
        f"(HOLDFAST_WORKER_CONCURRENCY {ctx.workers_for(1)} with 1 worker, "
        f"{ctx.workers_for(2)} each with 2, {options.idle_worker_concurrency} for the idle "
        f"rows; {SMALL_CONCURRENCY} for the provider, tool and recovery rows, whose "
        f"workers — 1, then {RECOVERY_WORKERS} for recovery — and tool-runner are "
        f"instrumented by bench.instrument), HOLDFAST_HEARTBEAT_SECONDS={options.heartbeat:g}; "
        f"Redis and PostgreSQL on this machine; client on "
        f"{'uvloop' if options.use_uvloop else 'asyncio'}."
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=max(150, shutil.get_terminal_size((160, 40)).columns))
    ctx = Context(args.options, console)
    rows = phases.run(ctx, args.selected)
    seconds = time.perf_counter() - ctx.started_at
    ordered = [row for name in phases.PHASES for row in rows.get(name, [])]
    console.print(render(ordered, caption(ctx, seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
