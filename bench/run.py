"""Holdfast performance bench: one table, every row measured in the same run.

    uv run python -m bench.run            # full run (a few minutes on 2 cores)
    uv run python -m bench.run --quick    # smaller sizes, for a smoke run

Rows: a raw redis-py XADD→XREAD baseline (1 and 100 streams); end-to-end
``text_delta`` throughput through gateway SSE (1 task, N concurrent tasks;
1 and 2 loop-workers) with its ratio to the baseline; the client parser's own
speed on a recorded stream (proof the client is not the bottleneck);
POST→``started`` latency; RSS per idle SSE connection and heartbeat
punctuality. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shutil
import sys
import time
import traceback
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bench import harness, raw, scenarios

T = TypeVar("T")

PHASES = ("raw", "e2e", "latency", "idle")

TARGET_RATIO = 0.3
TARGET_P50_MS = 10.0
TARGET_P99_MS = 50.0
TARGET_KB = 50.0
# The client parser must be at least this many times faster than the fastest
# engine row for the client not to matter.
CLIENT_HEADROOM = 10.0


@dataclass
class Sizes:
    raw_events: int
    raw_streams: int
    single_deltas: int
    tasks: int
    task_deltas: int
    latency_posts: int
    idle_connections: int
    idle_tasks: int
    idle_hold: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=(
            "Benchmark Holdfast end to end (a real gateway and loop-worker processes on the "
            "local Redis and PostgreSQL) against a raw redis-py XADD→XREAD baseline measured "
            "in the same run, and print one table with PASS/MISS against the targets. "
            "HOLDFAST_BENCH_REDIS_URL / HOLDFAST_BENCH_DATABASE_URL (an admin URL; a fresh "
            "database is created and dropped) override the local servers."
        ),
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
    g.add_argument("--idle-connections", type=int, help="idle SSE connections [1000; 200]")
    g.add_argument(
        "--idle-tasks",
        type=int,
        help="quietly running turns the idle connections follow, round robin "
        "[= --idle-connections: one task per connection]",
    )
    g.add_argument(
        "--idle-hold",
        type=float,
        help="seconds the idle connections are held while heartbeats are timed [20; 6]",
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
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} [all]",
    )
    e.add_argument(
        "--no-uvloop",
        action="store_true",
        help="run the bench client and raw baseline on the stdlib asyncio loop "
        "(default: uvloop, like the gateway)",
    )
    e.add_argument(
        "--pause-before",
        choices=("e2e", "latency", "idle"),
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
    e.add_argument("--keep-logs", action="store_true", help="keep the engine's log directory")
    args = p.parse_args(argv)

    def pick(value: Any, full: Any, small: Any) -> Any:
        return value if value is not None else (small if args.quick else full)

    idle_connections = pick(args.idle_connections, 1000, 200)
    args.sizes = Sizes(
        raw_events=pick(args.raw_events, 50_000, 10_000),
        raw_streams=args.raw_streams,
        single_deltas=pick(args.single_deltas, 20_000, 5_000),
        tasks=pick(args.tasks, 100, 50),
        task_deltas=pick(args.task_deltas, 1_000, 200),
        latency_posts=pick(args.latency_posts, 300, 50),
        idle_connections=idle_connections,
        idle_tasks=pick(args.idle_tasks, idle_connections, idle_connections),
        idle_hold=pick(args.idle_hold, 20.0, 6.0),
    )
    args.phase_set = {x.strip() for x in args.phases.split(",") if x.strip()}
    unknown = args.phase_set - set(PHASES)
    if unknown:
        p.error(f"unknown phases: {', '.join(sorted(unknown))}")
    return args


def _run(coro_fn: Callable[[], Coroutine[Any, Any, T]], use_uvloop: bool) -> T:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro_fn())
    return asyncio.run(coro_fn())


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}/s"


def verdict(ok: bool) -> str:
    return "[bold green]PASS[/]" if ok else "[bold red]MISS[/]"


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} CPU x {cpu}; Python {platform.python_version()}"


class Bench:
    def __init__(self, args: argparse.Namespace, console: Console) -> None:
        self.args = args
        self.sizes: Sizes = args.sizes
        self.console = console
        self.use_uvloop = not args.no_uvloop
        self.raw1: float | None = None
        self.raw_n: float | None = None
        self.engine_rates: list[float] = []
        self.recorded: list[bytes] = []
        self.redis_pid: int | None = None
        # Rows are kept per phase and printed in PHASES order, whatever the run order.
        self.rows: dict[str, list[tuple[str, ...]]] = {phase: [] for phase in PHASES}
        self.phase = "raw"
        self.worker_setup: tuple[int, int] | None = None
        self.engine = harness.Engine(
            redis_url=harness.redis_url(),
            admin_url=harness.admin_database_url(),
            heartbeat_seconds=args.heartbeat,
            worker_concurrency=args.idle_worker_concurrency,
        )

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')} {escape(text)}[/]")

    def row(
        self,
        label: str,
        result: str,
        base: str = "",
        ratio: str = "",
        target: str = "",
        detail: str = "",
        ok: bool | None = None,
    ) -> None:
        mark = "" if ok is None else verdict(ok)
        self.rows[self.phase].append((label, result, base, ratio, target, mark, escape(detail)))

    def pause(self, phase: str) -> None:
        if self.args.pause_before == phase:
            self.console.print(f"engine pids: {self.engine.pids()} — press Enter to run {phase}")
            sys.stdin.readline()

    @contextmanager
    def measured(self) -> Iterator[tuple[harness.CpuMeter, harness.PgConnections]]:
        pids = self.engine.pids()
        if self.redis_pid:
            pids["redis"] = self.redis_pid
        with harness.PgConnections(self.engine.admin_url, self.engine.db_name) as pg:
            with harness.CpuMeter(pids) as cpu:
                yield cpu, pg
        self.engine.check_alive()

    def workers_for(self, count: int) -> int:
        if self.args.worker_concurrency:
            return int(self.args.worker_concurrency)
        return max(1, math.ceil(self.sizes.tasks / count))

    def set_workers(self, count: int, concurrency: int) -> None:
        if self.worker_setup == (count, concurrency):
            return
        self.say(f"loop-workers: {count} x HOLDFAST_WORKER_CONCURRENCY={concurrency}")
        self.engine.set_workers(count, concurrency)
        self.worker_setup = (count, concurrency)
        _run(
            lambda: scenarios.warm_up(self.engine.gateway_url, self.engine.api_key, 4 * count),
            self.use_uvloop,
        )
        self.say(f"engine up and warm: {self.engine.pids()}")

    # -- phases ----------------------------------------------------------------
    def run_raw(self) -> None:
        s, engine = self.sizes, self.engine
        self.say(f"raw baseline: {s.raw_events:,} entries, 1 stream")
        self.raw1 = _run(
            lambda: raw.xadd_xread(engine.redis_url, engine.prefix, s.raw_events, 1),
            self.use_uvloop,
        )
        self.row(
            "raw redis-py XADD→XREAD, 1 stream",
            fmt_rate(self.raw1),
            detail=f"{s.raw_events:,} entries of ~150 B; 1 producer awaiting each XADD, "
            "1 consumer XREAD BLOCK COUNT 1000",
        )
        self.say(f"raw baseline: {s.raw_events:,} entries, {s.raw_streams} streams")
        self.raw_n = _run(
            lambda: raw.xadd_xread(engine.redis_url, engine.prefix, s.raw_events, s.raw_streams),
            self.use_uvloop,
        )
        self.row(
            f"raw redis-py XADD→XREAD, {s.raw_streams} streams",
            fmt_rate(self.raw_n),
            detail=f"{s.raw_events:,} entries; {s.raw_streams} producers, 1 consumer "
            f"XREADing all {s.raw_streams} keys",
        )

    def _throughput_rows(self, workers: int) -> None:
        s = self.sizes
        url, key = self.engine.gateway_url, self.engine.api_key
        suffix = f"{workers} worker" + ("s" if workers > 1 else "")
        label = f"E2E text_delta via SSE, 1 task x {s.single_deltas:,}, {suffix}"
        self.say(label)
        one = None
        with self.phase_errors(label), self.measured() as (cpu, pg):
            one = _run(lambda: scenarios.single_task(url, key, s.single_deltas), self.use_uvloop)
        if one is not None:
            if not self.recorded:
                self.recorded = one.recorded
            self.engine_rates.append(one.steady)
            self._ratio_row(label, one, self.raw1, cpu, pg)
        label = f"E2E text_delta via SSE, {s.tasks} tasks x {s.task_deltas:,}, {suffix}"
        self.say(label)
        many = None
        with self.phase_errors(label), self.measured() as (cpu, pg):
            many = _run(
                lambda: scenarios.concurrent_tasks(url, key, s.tasks, s.task_deltas),
                self.use_uvloop,
            )
        if many is not None:
            self.engine_rates.append(many.steady)
            self._ratio_row(label, many, self.raw_n, cpu, pg)

    def _ratio_row(
        self,
        label: str,
        t: scenarios.Throughput,
        base: float | None,
        cpu: harness.CpuMeter,
        pg: harness.PgConnections,
    ) -> None:
        ratio = t.from_post / base if base else None
        self.row(
            label,
            f"{fmt_rate(t.from_post)}\n(steady {fmt_rate(t.steady)})",
            fmt_rate(base) if base else "n/a",
            f"{ratio:.2f}" if ratio is not None else "n/a",
            f"≥ {TARGET_RATIO}",
            f"POST sent → last delta received (steady: first → last delta); "
            f"{t.total:,} deltas in {t.chunks:,} HTTP chunks, {t.wall:.2f} s. "
            f"CPU: {cpu.summary()}. {pg.summary()}",
            ok=None if ratio is None else ratio >= TARGET_RATIO,
        )

    def run_e2e(self) -> None:
        self.pause("e2e")
        self.set_workers(1, self.workers_for(1))
        self._throughput_rows(1)
        if self.recorded:
            rate, frames = scenarios.client_parse_rate(self.recorded)
            headroom = rate / max(self.engine_rates)
            self.row(
                "SSE client parser, recorded stream re-fed in memory",
                f"{rate:,.0f} frames/s",
                "",
                f"{headroom:.0f}x engine",
                f"≥ {CLIENT_HEADROOM:.0f}x fastest E2E row",
                f"the {frames:,} frames of the 1-task run, as the {len(self.recorded):,} chunks "
                "they arrived in; so the client is "
                + (
                    "not the bottleneck"
                    if headroom >= CLIENT_HEADROOM
                    else "POSSIBLY the bottleneck"
                ),
                ok=headroom >= CLIENT_HEADROOM,
            )
        if not self.args.no_two_workers:
            self.set_workers(2, self.workers_for(2))
            self._throughput_rows(2)

    def run_latency(self) -> None:
        self.pause("latency")
        n = self.sizes.latency_posts
        label = "POST→started latency"
        self.say(f"{label}: {n} sequential POSTs")
        lat = None
        with self.phase_errors(label), self.measured() as (cpu, pg):
            lat = _run(
                lambda: scenarios.post_to_started(self.engine.gateway_url, self.engine.api_key, n),
                self.use_uvloop,
            )
        if lat is None:
            return
        self.row(
            f"{label} p50",
            f"{lat.p50:.1f} ms",
            target=f"≤ {TARGET_P50_MS:.0f} ms",
            detail=f"{n} sequential POSTs on new tasks after 10 warm-up; request sent → "
            "'started' frame parsed; each turn read to its end",
            ok=lat.p50 <= TARGET_P50_MS,
        )
        self.row(
            f"{label} p99",
            f"{lat.p99:.1f} ms",
            target=f"≤ {TARGET_P99_MS:.0f} ms",
            detail=f"max {lat.max:.1f} ms. CPU: {cpu.summary()}. {pg.summary()}",
            ok=lat.p99 <= TARGET_P99_MS,
        )

    def run_idle(self) -> None:
        s, engine = self.sizes, self.engine
        label = f"{s.idle_connections:,} idle SSE"
        self.set_workers(1, self.args.idle_worker_concurrency)
        self.pause("idle")
        assert engine.gateway is not None
        self.say(
            f"idle: {s.idle_tasks:,} quiet turns, {s.idle_connections:,} replay streams, "
            f"hold {s.idle_hold:g} s"
        )
        idle = None
        with self.phase_errors(label), self.measured() as (_cpu, pg):
            idle = _run(
                lambda: scenarios.idle_connections(
                    engine.gateway_url,
                    engine.api_key,
                    engine.gateway.pid,  # type: ignore[union-attr]
                    connections=s.idle_connections,
                    tasks=s.idle_tasks,
                    hold_seconds=s.idle_hold,
                    heartbeat_seconds=self.args.heartbeat,
                ),
                self.use_uvloop,
            )
        if idle is None:
            return
        kb = idle.kb_per_connection
        mb = 1024 * 1024
        worker_rss = sum(harness.rss(p.pid) for p in engine.workers)
        self.row(
            f"{label}: gateway RSS per connection",
            f"{kb:.1f} KB",
            target=f"≤ {TARGET_KB:.0f} KB",
            detail=f"gateway RSS {idle.rss_before / mb:.1f} MB → {idle.rss_open / mb:.1f} MB "
            f"(all open) → {idle.rss_end / mb:.1f} MB (after {s.idle_hold:g} s), larger "
            f"used. GET /execute/replay on {idle.tasks:,} quietly running turns "
            f"(created in {idle.create_seconds:.1f} s), opened in "
            f"{idle.open_seconds:.1f} s; gateway CPU while idle "
            f"{idle.gateway_cpu_pct:.0f}%; the worker holds the {idle.tasks:,} quiet turns in "
            f"{worker_rss / mb:.0f} MB RSS. {pg.summary()}",
            ok=kb <= TARGET_KB,
        )
        gaps, hb = idle.gaps, idle.heartbeat_seconds
        pct = scenarios.percentile
        self.row(
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

    @contextmanager
    def phase_errors(self, label: str) -> Iterator[None]:
        """A failing measurement becomes an ERROR row; the run goes on."""
        try:
            yield
        except Exception as exc:
            self.console.print(f"[red]{escape(label)} failed:[/] {escape(repr(exc))}")
            self.console.print(escape(traceback.format_exc(limit=3)))
            self.console.print(escape(self.engine.log_tail()))
            self.row(
                label, "[bold red]ERROR[/]", detail=f"{type(exc).__name__}: {exc}"[:300], ok=False
            )

    # -- the whole run ---------------------------------------------------------
    def run(self) -> int:
        args, s, engine = self.args, self.sizes, self.engine
        nofile = harness.raise_nofile(max(4096, 4 * s.idle_connections + 1024))
        if args.wait_quiet > 0:
            busy = harness.wait_quiet(args.wait_quiet)
            self.say(f"machine busy {busy:.0f}% of one core before the run")
        self.redis_pid = _run(lambda: _redis_pid(engine.redis_url), False)
        started = time.perf_counter()
        self.say(
            f"run {engine.run_id}: database {engine.db_name}, Redis prefix {engine.prefix}, "
            f"RLIMIT_NOFILE {nofile}, client loop "
            f"{'uvloop' if self.use_uvloop else 'asyncio'}; logs in {engine.log_dir}"
        )
        try:
            engine.create_database()
            if "raw" in args.phase_set:
                self.phase = "raw"
                self.run_raw()
            if args.phase_set & {"e2e", "latency", "idle"}:
                engine.start_gateway()
                self.set_workers(1, self.workers_for(1))
            for phase, fn in (
                ("latency", self.run_latency),
                ("e2e", self.run_e2e),
                ("idle", self.run_idle),
            ):
                if phase in args.phase_set:
                    self.phase = phase
                    fn()
        except BaseException:
            self.console.print("[red]bench failed; engine logs:[/]\n" + escape(engine.log_tail()))
            raise
        finally:
            self.say("stopping the engine and cleaning up")
            engine.stop()
            deleted = _run(engine.delete_redis_keys, False)
            engine.drop_database()
            if not args.keep_logs:
                shutil.rmtree(engine.log_dir, ignore_errors=True)
            self.say(f"deleted {deleted} Redis keys, dropped database {engine.db_name}")
        self.print_table(time.perf_counter() - started)
        return 0

    def print_table(self, seconds: float) -> None:
        args = self.args
        table = Table(title=f"Holdfast bench — {machine()}", show_lines=True)
        table.add_column("Measurement", max_width=34)
        table.add_column("Result", justify="right", no_wrap=True)
        table.add_column("Raw baseline", justify="right", no_wrap=True)
        table.add_column("Ratio", justify="right", no_wrap=True)
        table.add_column("Target", max_width=22)
        table.add_column("", no_wrap=True)
        table.add_column("Detail", max_width=70)
        for phase in PHASES:
            for cells in self.rows[phase]:
                table.add_row(*cells)
        table.caption = (
            f"All rows from one run ({seconds:.0f} s): 1 gateway, loop-workers as stated "
            f"(HOLDFAST_WORKER_CONCURRENCY {self.workers_for(1)} with 1 worker, "
            f"{self.workers_for(2)} each with 2, {args.idle_worker_concurrency} for the idle "
            f"rows), HOLDFAST_HEARTBEAT_SECONDS={args.heartbeat:g}; Redis and PostgreSQL on "
            f"this machine; client on {'uvloop' if self.use_uvloop else 'asyncio'}."
        )
        self.console.print(table)


async def _redis_pid(url: str) -> int | None:
    from holdfast_shared.redisconn import connect

    client = connect(url)
    try:
        info = await client.info("server")
    finally:
        await client.aclose()
    return harness.redis_server_pid(info)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(width=max(150, shutil.get_terminal_size((160, 40)).columns))
    return Bench(args, console).run()


if __name__ == "__main__":
    raise SystemExit(main())
