"""What every phase receives: the run's options, its engine and the helpers
that measure, plus the few results one phase leaves for another.

A phase is a plain function ``run(ctx) -> list[Row]`` (``bench.phases``). It
is not a coroutine: each measurement runs on an event loop of its own,
uvloop for the client measurements (like the gateway) and stdlib asyncio for
those that stand in for a loop-worker or a tool-runner, and the engine's
processes are started and stopped synchronously between measurements.
"""

from __future__ import annotations

import asyncio
import json
import math
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

from bench import harness, providers, scenarios
from bench.instrument import ENV as SPANS_ENV
from bench.instrument import WORKER_CODE, Spans
from bench.table import Row

T = TypeVar("T")

# Worker concurrency of the providers, tools and recovery rows (small: their
# turns are few at a time, and PostgreSQL has 100 connections), but at least
# --recovery-turns: one surviving worker must be able to take over every turn
# of the killed ones at once, or a takeover also waits for a free slot.
SMALL_CONCURRENCY = 16


@dataclass(frozen=True)
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
    scale_turns: int  # turns per loop-worker of the turns/s row (bench.phases.scale)
    capacity_steps: tuple[int, ...]  # concurrent live turns tried (bench.phases.capacity)
    capacity_hold: float  # seconds every step's turns all stream at once


@dataclass(frozen=True)
class Options:
    """Everything ``bench.run``'s arguments decide, but which phases run."""

    sizes: Sizes
    heartbeat: float  # HOLDFAST_HEARTBEAT_SECONDS of the gateway
    worker_concurrency: int | None  # of the latency and throughput rows' workers; None: derived
    idle_worker_concurrency: int
    two_workers: bool  # also the throughput rows with two loop-workers
    use_uvloop: bool  # the bench client's loop
    pause_before: str | None  # a phase's name
    wait_quiet: float  # seconds; 0: don't wait
    sandbox_gap_ms: float
    keep_logs: bool


def run_async(coro_fn: Callable[[], Coroutine[Any, Any, T]], use_uvloop: bool) -> T:
    """Run one measurement on a fresh event loop: uvloop if asked and installed."""
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(coro_fn())
    return asyncio.run(coro_fn())


class Context:
    """One bench run: its engine (a fresh database, a Redis prefix, real
    processes), its options, and what phases hand on to later ones."""

    def __init__(self, options: Options, console: Console) -> None:
        self.options = options
        self.sizes = options.sizes
        self.console = console
        self.use_uvloop = options.use_uvloop
        self.engine = harness.Engine(
            redis_url=harness.redis_url(),
            admin_url=harness.admin_database_url(),
            heartbeat_seconds=options.heartbeat,
            worker_concurrency=options.idle_worker_concurrency,
        )
        # The raw baselines (events/s, 1 stream and N streams), set by the raw
        # phase; the providers phase measures the first itself when raw did not run.
        self.raw1: float | None = None
        self.raw_n: float | None = None
        # The same with the producers' XADDs pipelined (bench.raw.pipelined): the
        # most Redis takes here; the throughput rows report their ratio to it too.
        self.raw1_pipelined: float | None = None
        self.raw_n_pipelined: float | None = None
        # The instrumented workers' environment and provider server, shared by
        # the providers, tools and recovery phases (see instrumented()).
        self.provider_url: str | None = None
        self.instrumented_env: dict[str, str] = {}
        self.worker_setup: tuple[Any, ...] | None = None
        self.redis_pid: int | None = None
        self.started_at = 0.0

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')} {escape(text)}[/]")

    def pause(self, phase: str) -> None:
        if self.options.pause_before == phase:
            self.console.print(f"engine pids: {self.engine.pids()} — press Enter to run {phase}")
            sys.stdin.readline()

    @contextmanager
    def measured(self) -> Iterator[tuple[harness.CpuMeter, harness.PgConnections]]:
        """CPU of every process and PostgreSQL connections while the block runs;
        afterwards, every engine process must still be alive."""
        pids = self.engine.pids()
        if self.redis_pid:
            pids["redis"] = self.redis_pid
        with harness.PgConnections(self.engine.admin_url, self.engine.db_name) as pg:
            with harness.CpuMeter(pids) as cpu:
                yield cpu, pg
        self.engine.check_alive()

    @contextmanager
    def errors_to(self, rows: list[Row], label: str) -> Iterator[None]:
        """A failing measurement becomes an ERROR row in ``rows``; the run goes on."""
        try:
            yield
        except Exception as exc:
            self.console.print(f"[red]{escape(label)} failed:[/] {escape(repr(exc))}")
            self.console.print(escape(traceback.format_exc(limit=3)))
            self.console.print(escape(self.engine.log_tail()))
            rows.append(Row.error(label, exc))

    # -- loop-workers -------------------------------------------------------------
    def workers_for(self, count: int) -> int:
        """Worker concurrency of the latency and throughput rows with ``count`` workers."""
        if self.options.worker_concurrency:
            return int(self.options.worker_concurrency)
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
            self.engine.add_workers(count - current[0], concurrency, extra_env, code)
        else:
            self.say(f"loop-workers{how}: {count} x HOLDFAST_WORKER_CONCURRENCY={concurrency}")
            self.engine.set_workers(count, concurrency, extra_env, code)
        self.worker_setup = setup
        run_async(
            lambda: scenarios.warm_up(self.engine.gateway_url, self.engine.api_key, 4 * count),
            self.use_uvloop,
        )
        self.say(f"engine up and warm: {self.engine.pids()}")

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

    # -- the whole run -------------------------------------------------------------
    @contextmanager
    def session(self) -> Iterator[None]:
        """The run's database, from before the first phase to after the last; then
        the engine is stopped and its Redis keys, database and logs removed."""
        options, engine = self.options, self.engine
        nofile = harness.raise_nofile(max(4096, 4 * self.sizes.idle_connections + 1024))
        if options.wait_quiet > 0:
            busy = harness.wait_quiet(options.wait_quiet)
            self.say(f"machine busy {busy:.0f}% of one core before the run")
        self.redis_pid = run_async(lambda: _redis_pid(engine.redis_url), False)
        self.started_at = time.perf_counter()
        try:
            engine.open()
            self.say(
                f"run {engine.run_id}: database {engine.db_name}, Redis prefix {engine.prefix}, "
                f"RLIMIT_NOFILE {nofile}, client loop "
                f"{'uvloop' if self.use_uvloop else 'asyncio'}; logs in {engine.log_dir}"
            )
            yield
        except BaseException:
            self.console.print("[red]bench failed; engine logs:[/]\n" + escape(engine.log_tail()))
            raise
        finally:
            self.say("stopping the engine and cleaning up")
            db_name = engine.db_name if engine.is_open else "(none)"
            deleted = engine.close()
            if not options.keep_logs:
                shutil.rmtree(engine.log_dir, ignore_errors=True)
            self.say(f"deleted {deleted} Redis keys, dropped database {db_name}")


async def _redis_pid(url: str) -> int | None:
    from holdfast_shared.redisconn import connect

    client = connect(url)
    try:
        info = await client.info("server")
    finally:
        await client.aclose()
    return harness.redis_server_pid(info)
