"""Holdfast performance bench: one table, every row measured in the same run.

    uv run python -m bench.run            # full run (a few minutes on 2 cores)
    uv run python -m bench.run --quick    # smaller sizes, for a smoke run

Rows: a raw redis-py XADD→XREAD baseline (1 and 100 streams); end-to-end
``text_delta`` throughput through gateway SSE (1 task, N concurrent tasks;
1 and 2 loop-workers) with its ratio to the baseline; the client parser's own
speed on a recorded stream (proof the client is not the bottleneck);
POST→``started`` latency; RSS per idle SSE connection and heartbeat
punctuality; a real provider SDK against a zero-latency wire-protocol server
(added first-delta latency, deltas/s); sandboxed tool execs and the tool
round trip; worker-kill takeover and snapshot cost. See docs/performance.md.

    uv run python -m bench.run --only providers,tools   # a subset of the phases
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from bench import harness, providers, raw, recovery, scenarios, tools
from bench.instrument import ENV as SPANS_ENV
from bench.instrument import RUNNER_CODE, WORKER_CODE, Spans

T = TypeVar("T")

# Table order. The idle phase runs last whatever the order: it leaves 1,000
# endless turns on its worker.
PHASES = ("raw", "e2e", "latency", "idle", "providers", "tools", "recovery")
RUN_ORDER = ("latency", "e2e", "providers", "tools", "recovery", "idle")
ENGINE_PHASES = frozenset(PHASES) - {"raw"}

TARGET_RATIO = 0.3
TARGET_P50_MS = 10.0
TARGET_P99_MS = 50.0
TARGET_KB = 50.0
# The client parser must be at least this many times faster than the fastest
# engine row for the client not to matter.
CLIENT_HEADROOM = 10.0
TARGET_PROVIDER_ADDED_MS = 5.0
TARGET_SANDBOX_OVERHEAD_MS = 15.0
TARGET_TOOL_ROUND_TRIP_MS = 25.0
TARGET_TAKEOVER_P99_S = 15.0
TARGET_SNAPSHOT_MS = 5.0
# Worker concurrency of the providers, tools and recovery rows (small: their
# turns are few at a time, and PostgreSQL has 100 connections), but at least
# --recovery-turns: one surviving worker must be able to take over every turn
# of the killed ones at once, or a takeover also waits for a free slot.
SMALL_CONCURRENCY = 16
RECOVERY_WORKERS = 3
DEFAULT_LEASE_SECONDS = 10  # HOLDFAST_LEASE_SECONDS's default, left unset by the bench


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
    provider_turns: int
    provider_deltas: int
    sandbox_runs: int
    exec_seconds: float
    exec_concurrency: int
    tool_turns: int
    snapshot_saves: int
    snapshot_turns: int
    recovery_rounds: int
    recovery_kills: int
    recovery_turns: int


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
        "--only",
        dest="phases",
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
        choices=RUN_ORDER,
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
        self.provider_url: str | None = None
        self.instrumented_env: dict[str, str] = {}
        self.raw_n: float | None = None
        self.engine_rates: list[float] = []
        self.recorded: list[bytes] = []
        self.redis_pid: int | None = None
        # Rows are kept per phase and printed in PHASES order, whatever the run order.
        self.rows: dict[str, list[tuple[str, ...]]] = {phase: [] for phase in PHASES}
        self.phase = "raw"
        self.worker_setup: tuple[Any, ...] | None = None
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

    def set_workers(
        self,
        count: int,
        concurrency: int,
        extra_env: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        setup = (count, concurrency, sorted((extra_env or {}).items()), code)
        if self.worker_setup == setup:
            return
        how = " (instrumented)" if code else ""
        current = self.worker_setup
        if current is not None and current[1:] == setup[1:] and current[0] < count:
            # The same kind of worker, more of them: keep the running ones.
            self.say(f"loop-workers{how}: {count - current[0]} more")
            engine = self.engine
            added = [
                engine.start_worker(concurrency, extra_env, code) for _ in range(count - current[0])
            ]
            asyncio.run(engine.wait_consumers(added))
        else:
            self.say(f"loop-workers{how}: {count} x HOLDFAST_WORKER_CONCURRENCY={concurrency}")
            self.engine.set_workers(count, concurrency, extra_env, code)
        self.worker_setup = setup
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

    # -- providers, tools, recovery -------------------------------------------------
    def instrumented(self, count: int) -> tuple[Spans, str]:
        """``count`` instrumented loop-workers (bench.instrument), all alike for the
        providers, tools and recovery phases, so the phases can share them: the
        Anthropic key and base URL of the bench's provider server (started here,
        once), bash allowed, and one span directory. Returns the spans and the
        provider server's URL."""
        engine = self.engine
        if self.provider_url is None:
            providers.check_clock()
            _proc, self.provider_url = engine.start_helper("provider", providers.SERVER_CODE)
            self.say(f"provider server {self.provider_url} (Anthropic wire protocol)")
        directory = engine.log_dir / "spans"
        directory.mkdir(exist_ok=True)
        env = {
            "ANTHROPIC_API_KEY": "x",
            "ANTHROPIC_BASE_URL": self.provider_url,
            "HOLDFAST_TOOL_PERMISSIONS": json.dumps({"*": {"bash": "allow"}}),
            SPANS_ENV: str(directory),
        }
        self.set_workers(count, SMALL_CONCURRENCY, env, WORKER_CODE)
        self.instrumented_env = env
        return Spans(directory), self.provider_url

    def run_providers(self) -> None:
        s, engine, uv = self.sizes, self.engine, self.use_uvloop
        url, key = engine.gateway_url, engine.api_key
        base_note = ""
        if self.raw1 is None:
            n = min(s.raw_events, 20_000)
            self.say(f"raw baseline for the provider row: {n:,} entries, 1 stream")
            with self.phase_errors("raw baseline (1 stream)"):
                self.raw1 = _run(lambda: raw.xadd_xread(engine.redis_url, engine.prefix, n, 1), uv)
                base_note = f" Raw baseline measured in this phase ({n:,} entries)."
        label = "Provider first byte → client's first text_delta"
        ready = False
        with self.phase_errors(f"{label}: set-up"):
            spans, server = self.instrumented(1)
            self.pause("providers")
            _run(lambda: providers.warm_up(url, key), uv)
            _run(lambda: providers.fetch_stamps(server), uv)  # drop the warm-up's stamps
            ready = True
        if ready:
            self._provider_rows(url, key, server, spans, base_note)

    def _provider_rows(self, url: str, key: str, server: str, spans: Spans, note: str) -> None:
        s, uv, pct = self.sizes, self.use_uvloop, scenarios.percentile
        label = "Provider first byte → client's first text_delta"
        self.say(f"{label}: {s.provider_turns} sequential turns")
        lat = None
        with self.phase_errors(label), self.measured() as (cpu, pg):
            lat = _run(
                lambda: providers.first_delta_latency(
                    url, key, server, s.provider_turns, 10, spans
                ),
                uv,
            )
        if lat is not None:
            split = (
                f" Split at p50: server first byte → the worker starts the append carrying "
                f"the first delta (httpx + SDK SSE parsing of message_start, "
                f"content_block_start, ping, the delta; translation; emit) "
                f"{pct(lat.to_emit_ms, 50):.2f} ms; that append (Lua XADD) "
                f"{pct(lat.append_ms, 50):.2f} ms; append done → client parsed the frame "
                f"(gateway XREAD fan-out, SSE, loopback, httpx) {pct(lat.to_client_ms, 50):.2f} ms."
                if lat.to_emit_ms
                else ""
            )
            self.row(
                f"{label} (Anthropic SDK, zero-latency wire server)",
                f"p50 {lat.p50:.2f} ms\np99 {lat.p99:.2f} ms",
                target=f"added p50 ≤ {TARGET_PROVIDER_ADDED_MS:g} ms",
                detail=f"{s.provider_turns} sequential turns on new tasks after 10 warm-up, "
                f"3 deltas each; the server (own process) stamps perf_counter as its response "
                f"yields message_start, the client as it parses the first text_delta frame "
                f"(CLOCK_MONOTONIC: one clock for all processes).{split} For context: POST "
                f"sent → request at the provider p50 {pct(lat.to_provider_ms, 50):.1f} ms; POST "
                f"→ first delta p50 {pct(lat.post_to_delta_ms, 50):.1f} ms. CPU: "
                f"{cpu.summary()}. {pg.summary()}",
                ok=lat.p50 <= TARGET_PROVIDER_ADDED_MS,
            )
        label = f"Provider stream → SSE text_delta, 1 turn x {s.provider_deltas:,}, 1 worker"
        self.say(label)
        thr = None
        with self.phase_errors(label), self.measured() as (cpu, pg):
            thr = _run(lambda: providers.throughput(url, key, server, s.provider_deltas), uv)
        if thr is not None:
            ratio = thr.from_post / self.raw1 if self.raw1 else None
            self.row(
                label,
                f"{fmt_rate(thr.from_post)}\n(steady {fmt_rate(thr.steady)})",
                fmt_rate(self.raw1) if self.raw1 else "n/a",
                f"{ratio:.2f}" if ratio is not None else "n/a",
                "(none set)",
                f"POST sent → last delta received (steady: first → last delta); the Anthropic "
                f"SDK in the worker reads a zero-delay server that wrote all "
                f"{thr.deltas + 6:,} events ({providers.BATCH_EVENTS} per write) in "
                f"{thr.server_seconds * 1000:.0f} ms; the last delta reached the client "
                f"{thr.server_to_client_last_ms:.0f} ms after the server's last byte. "
                f"{thr.deltas:,} deltas in {thr.chunks:,} HTTP chunks, {thr.wall:.2f} s. CPU: "
                f"{cpu.summary()}. {pg.summary()}.{note}",
            )

    def run_tools(self) -> None:
        s, engine, pct = self.sizes, self.engine, scenarios.percentile
        # Under the log directory: mkdtemp made it 0700 and root-owned, which the
        # sandbox requires of a workspace's parent when it runs as root.
        workspaces = tools.make_workspaces(engine.log_dir / "sandbox", max(1, s.exec_concurrency))
        label = "Sandboxed exec overhead vs bare exec (`true`)"
        self.say(f"{label}: {s.sandbox_runs} pairs")
        sb = None
        with self.phase_errors(label), self.measured() as (cpu, _pg):
            sb = _run(
                lambda: tools.sandbox_overhead(
                    workspaces[0], s.sandbox_runs, self.args.sandbox_gap_ms
                ),
                False,
            )
        if sb is not None:
            mech = ", ".join(f"{k} {v}" for k, v in sb.mechanisms.items())
            self.row(
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
        label = f"Sandboxed execs/s, one runner's concurrency ({len(workspaces)})"
        self.say(f"{label}: {s.exec_seconds:g} s")
        rate = None
        with self.phase_errors(label), self.measured() as (cpu, _pg):
            rate = _run(lambda: tools.exec_rate(workspaces, s.exec_seconds), False)
        if rate is not None:
            self.row(
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
        self._tool_round_trip(sb)

    def _tool_round_trip(self, sb: tools.SandboxOverhead | None) -> None:
        s, engine, pct = self.sizes, self.engine, scenarios.percentile
        label = "Tool round trip (loop-worker → tool-runner → result), beyond the exec"
        rt = None
        with self.phase_errors(label):
            spans, _server = self.instrumented(1)
            engine.start_tool_runner(
                {
                    "HOLDFAST_WORKSPACE_ROOT": str(engine.log_dir / "workspaces"),
                    SPANS_ENV: str(spans.directory),
                },
                RUNNER_CODE,
            )
            self.pause("tools")
            self.say(f"{label}: {s.tool_turns} sequential turns")
            with self.measured() as (cpu, pg):
                rt = _run(
                    lambda: tools.round_trips(
                        engine.gateway_url, engine.api_key, s.tool_turns, spans
                    ),
                    self.use_uvloop,
                )
        engine.stop_tool_runners()
        if rt is None:
            return
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
        self.row(
            label,
            f"{overhead:.1f} ms p50",
            f"{exec_ms:.1f} ms exec",
            "",
            f"≤ {TARGET_TOOL_ROUND_TRIP_MS:g} ms p50",
            f"tool_call frame → tool_result frame at the client, {s.tool_turns} sequential "
            f"turns after 5 warm-up, each on a new task with one bash `true` call: p50 "
            f"{rt.p50:.1f} ms, p99 {rt.p99:.1f} ms, minus {exec_note} ({exec_ms:.1f} ms){in_situ}. "
            f"Step by step, p50 ms (instrumented worker and runner, one clock): {steps}. "
            f"Single steps inside them, p50 ms: {inner}. CPU: "
            f"{cpu.summary()}. {pg.summary()}",
            ok=overhead <= TARGET_TOOL_ROUND_TRIP_MS,
        )

    def run_recovery(self) -> None:
        s, engine, pct = self.sizes, self.engine, scenarios.percentile
        label = "Snapshot save (Snapshots.save: one PostgreSQL INSERT)"
        self.say(f"{label}: {s.snapshot_saves} saves")
        ss = None
        with self.phase_errors(label), self.measured() as (cpu, pg):
            ss = _run(lambda: recovery.snapshot_saves(engine.database_url, s.snapshot_saves), False)
        if ss is not None:
            p50 = pct(ss.saves_ms, 50)
            self.row(
                label,
                f"p50 {p50:.2f} ms\np99 {pct(ss.saves_ms, 99):.2f} ms",
                target=f"≤ {TARGET_SNAPSHOT_MS:g} ms p50",
                detail=f"{len(ss.saves_ms)} saves of a {ss.state_bytes:,}-byte mid-turn state "
                f"(2 pending tool calls, one with its output) straight to the bench database "
                f"through the engine's create_engine (pool_pre_ping on), stdlib asyncio. "
                f"Interleaved, the same save without the pre-ping: p50 "
                f"{pct(ss.no_ping_ms, 50):.2f} ms; and also with synchronous_commit=off "
                f"(COMMIT does not wait for the WAL flush): p50 "
                f"{pct(ss.no_ping_async_commit_ms, 50):.2f} ms. CPU: {cpu.summary()}",
                ok=p50 <= TARGET_SNAPSHOT_MS,
            )
        label = "Snapshot per iteration in a loop-worker (drain + one transaction)"
        spans: Spans | None = None
        with self.phase_errors(label):
            spans, _server = self.instrumented(RECOVERY_WORKERS)
            self.pause("recovery")
            self.say(f"{label}: {s.snapshot_turns} short turns")
            start = time.perf_counter()
            with self.measured() as (cpu, pg):
                _run(
                    lambda: recovery.quick_turns(
                        engine.gateway_url, engine.api_key, s.snapshot_turns
                    ),
                    self.use_uvloop,
                )
            window = (start, time.perf_counter())
            spans.reload()
            total = spans.durations_ms("snapshot", window=window)
            drain = spans.durations_ms("snapshot.drain", window=window)
            write = spans.durations_ms("snapshot.write", window=window)
            if not total:
                raise RuntimeError("the instrumented workers recorded no snapshot")
            self.row(
                label,
                f"p50 {pct(total, 50):.2f} ms\np99 {pct(total, 99):.2f} ms",
                target=f"≤ {TARGET_SNAPSHOT_MS:g} ms p50",
                detail=f"{len(total)} TurnRunner._snapshot calls (one per model call) in "
                f"{s.snapshot_turns} sequential short turns on {RECOVERY_WORKERS} instrumented "
                f"workers: waiting for the emitter to drain p50 {pct(drain, 50):.2f} ms, p99 "
                f"{pct(drain, 99):.2f} ms; one PostgreSQL transaction with the task's "
                f"unarchived events, the step's message and the state (EventLog.archive_now) "
                f"p50 {pct(write, 50):.2f} ms, p99 {pct(write, 99):.2f} ms. CPU: "
                f"{cpu.summary()}. {pg.summary()}",
                ok=pct(total, 50) <= TARGET_SNAPSHOT_MS,
            )
        label = "Worker SIGKILL → the turn's next event from another worker"
        if spans is None:
            return
        kills = s.recovery_kills
        self.say(
            f"{label}: {s.recovery_rounds} rounds of {s.recovery_turns} slow turns on "
            f"{RECOVERY_WORKERS} workers, {kills} SIGKILLs each, default lease"
        )
        rec = None
        started = time.perf_counter()
        with self.phase_errors(label), self.measured() as (cpu, pg):
            rec = _run(
                lambda: recovery.takeovers(
                    engine,
                    rounds=s.recovery_rounds,
                    kills_per_round=kills,
                    turns=s.recovery_turns,
                    concurrency=SMALL_CONCURRENCY,
                    worker_env=self.instrumented_env,
                    worker_code=WORKER_CODE,
                ),
                self.use_uvloop,
            )
        if rec is None:
            self.worker_setup = None  # some workers may be gone
            return
        spans.reload()
        recovery.attribute(rec, spans)
        gaps = rec.all("gaps_s")
        lease = rec.all("remaining_lease_s")
        pickup = rec.all("pickup_s")
        resume = rec.all("resume_ms")
        spread = "; ".join(sorted({"/".join(map(str, k.spread)) for k in rec.kills}))
        self.row(
            f"{label} (default {DEFAULT_LEASE_SECONDS} s lease)",
            f"p50 {pct(gaps, 50):.2f} s\np99 {pct(gaps, 99):.2f} s",
            target=f"p99 ≤ {TARGET_TAKEOVER_P99_S:g} s",
            detail=f"{len(gaps)} turns over {len(rec.kills)} SIGKILLs in {rec.rounds} rounds "
            f"({RECOVERY_WORKERS} workers; {rec.turns_per_round} slow turns per round, per "
            f"worker {spread}; the {kills} workers holding the most killed each at its own "
            f"random moment 0-3.5 s after all streamed, and replaced); gap = kill → client "
            f"receives turn_resumed; min {min(gaps):.2f} s, max {max(gaps):.2f} s. Lease left "
            f"at the kill p50 {pct(lease, 50):.2f} s (min {min(lease, default=math.nan):.2f}, max "
            f"{max(lease, default=math.nan):.2f}); kill → the new worker starts announcing "
            f"the resume p50 {pct(pickup, 50):.2f} s; → client has turn_resumed p50 "
            f"{pct(resume, 50):.0f} ms. {time.perf_counter() - started:.0f} s in all; machine "
            f"CPU {cpu.machine:.0f}% of {100 * (os.cpu_count() or 1)}%. {pg.summary()}",
            ok=pct(gaps, 99) <= TARGET_TAKEOVER_P99_S,
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
            if args.phase_set & ENGINE_PHASES:
                engine.start_gateway()
            if args.phase_set & {"e2e", "latency"}:
                self.set_workers(1, self.workers_for(1))
            for phase in RUN_ORDER:
                if phase in args.phase_set:
                    self.phase = phase
                    getattr(self, f"run_{phase}")()
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
            f"rows; {SMALL_CONCURRENCY} for the provider, tool and recovery rows, whose "
            f"workers — 1, then {RECOVERY_WORKERS} for recovery — and tool-runner are "
            f"instrumented by bench.instrument), HOLDFAST_HEARTBEAT_SECONDS={args.heartbeat:g}; "
            f"Redis and PostgreSQL on this machine; client on "
            f"{'uvloop' if self.use_uvloop else 'asyncio'}."
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
