"""The bench's own engine, started by ``holdfast.testing``, and what the bench measures with.

Nothing here is shared with a running engine: the environment creates the
database ``hfbench_<hex>`` and drops it, keeps every Redis key under
``hfbench:<hex>:`` and deletes them, and its processes are the bench's own
children, ready by the harness's one rule and stopped by pid. The bench adds
its entry points (``code``: instrumented services, run with the repository
on ``PYTHONPATH``) and helper processes (the fake provider server).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import psycopg
from sqlalchemy.engine import make_url

from holdfast.testing import EngineEnvironment, Process
from holdfast.testing.database import libpq_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REPO_ROOT = str(Path(__file__).resolve().parent.parent)
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432"
READY_SECONDS = 60.0


def redis_url() -> str:
    return os.environ.get("HOLDFAST_BENCH_REDIS_URL", DEFAULT_REDIS_URL)


def admin_database_url() -> str:
    return os.environ.get("HOLDFAST_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)


def _psycopg_url(url: str) -> str:
    return libpq_url(url)


def raise_nofile(wanted: int) -> int:
    """Raise the soft open-files limit (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def _command(code: str | None) -> list[str] | None:
    return None if code is None else [sys.executable, "-c", code]


def _env(code: str | None, extra: dict[str, str] | None) -> dict[str, str]:
    """``extra``, and for bench code run inside an engine process (bench.instrument,
    the fake provider) the repository root on ``PYTHONPATH``, to import it from."""
    env = dict(extra or {})
    if code is not None:
        path = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (REPO_ROOT, path)))
    return env


@dataclass
class Engine:
    """A database, a Redis prefix, an API key, and the engine's processes:
    an :class:`EngineEnvironment` from :meth:`open` to :meth:`close`."""

    redis_url: str
    admin_url: str
    heartbeat_seconds: float
    worker_concurrency: int
    # Helper processes (the fake provider server), stopped with the rest.
    helpers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # The environment's directory: process logs in logs/, spans, workspaces.
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hfbench-")))
    _environment: EngineEnvironment | None = None

    def open(self) -> None:
        """Create the database (migrated, with the bench's API key) and the prefix."""
        self._environment = EngineEnvironment(
            redis_url=self.redis_url,
            postgres_url=self.admin_url,
            directory=self.log_dir,
            name="hfbench",
            tenant="tenant-bench",
            env={
                "HOLDFAST_HEARTBEAT_SECONDS": str(self.heartbeat_seconds),
                "HOLDFAST_MODEL": "scripted",
                "HOLDFAST_LOG_LEVEL": "WARNING",
                "HOLDFAST_WORKER_CONCURRENCY": str(self.worker_concurrency),
                # The MCP phase's server listens on loopback (holdfast_shared.outbound).
                "HOLDFAST_OUTBOUND_ALLOW": "127.0.0.1/32,::1/128,localhost",
            },
        )

    @property
    def is_open(self) -> bool:
        return self._environment is not None

    @property
    def environment(self) -> EngineEnvironment:
        if self._environment is None:
            raise RuntimeError("the bench engine is not open")
        return self._environment

    @property
    def run_id(self) -> str:
        return self.environment.run_id

    @property
    def api_key(self) -> str:
        return self.environment.api_key

    @property
    def prefix(self) -> str:
        return self.environment.prefix

    @property
    def database_url(self) -> str:
        return self.environment.database_url

    @property
    def db_name(self) -> str:
        return str(make_url(self.database_url).database)

    @property
    def gateway(self) -> Process | None:
        gateways = self.environment.of("gateway") if self._environment else []
        return gateways[0] if gateways else None

    @property
    def gateway_url(self) -> str:
        return self.environment.url

    @property
    def workers(self) -> list[Process]:
        return self.environment.of("loop-worker") if self._environment else []

    @property
    def runners(self) -> list[Process]:
        return self.environment.of("tool-runner") if self._environment else []

    # -- processes -------------------------------------------------------------
    def start_gateway(
        self, code: str | None = None, extra_env: dict[str, str] | None = None
    ) -> str:
        """Start the gateway (``code``: another entry point) and wait until it is healthy."""
        self.environment.start(
            "gateway", env=_env(code, extra_env), command=_command(code), within=READY_SECONDS
        )
        return self.gateway_url

    def start_worker(
        self,
        concurrency: int | None = None,
        extra_env: dict[str, str] | None = None,
        code: str | None = None,
    ) -> Process:
        """Start a loop-worker (``code``: another entry point, e.g. an instrumented
        one); not waited for (:meth:`wait_ready`)."""
        extra = {} if concurrency is None else {"HOLDFAST_WORKER_CONCURRENCY": str(concurrency)}
        extra.update(extra_env or {})
        return self.environment.start(
            "loop-worker", env=_env(code, extra), command=_command(code), wait=False
        )

    def set_workers(
        self,
        count: int,
        concurrency: int,
        extra_env: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        """Replace the running loop-workers by ``count`` new ones, each ready."""
        self.stop_workers()
        self.add_workers(count, concurrency, extra_env, code)

    def add_workers(
        self,
        count: int,
        concurrency: int,
        extra_env: dict[str, str] | None = None,
        code: str | None = None,
    ) -> list[Process]:
        """Start ``count`` more loop-workers side by side; return once each is ready."""
        procs = [self.start_worker(concurrency, extra_env, code) for _ in range(count)]
        self.environment.wait_ready(*procs, within=READY_SECONDS)
        return procs

    async def until_ready(self, procs: list[Process]) -> None:
        """Wait until every one of ``procs`` is ready (the harness's one rule)."""
        await self.environment.until_ready(*procs, within=READY_SECONDS)

    def kill_worker(self, proc: Process) -> None:
        """SIGKILL one loop-worker (a crash, as far as the engine can tell)."""
        self.environment.kill(proc)

    def start_tool_runner(
        self, extra_env: dict[str, str] | None = None, code: str | None = None
    ) -> Process:
        return self.environment.start(
            "tool-runner", env=_env(code, extra_env), command=_command(code), within=READY_SECONDS
        )

    def stop_tool_runners(self) -> None:
        self.environment.kill_all(signal.SIGTERM, grace=10, kind="tool-runner")

    def start_helper(
        self, name: str, code: str, extra_env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], str]:
        """Start a bench helper process (``code``) that prints one line, e.g. its URL,
        when it is ready; returns the process and that line."""
        env = {**self.environment.env, **_env(code, extra_env)}
        with (self.environment.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=REPO_ROOT,
            )
        self.helpers[name] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        if not line:
            raise RuntimeError(f"{name} exited with {proc.wait()}; {self.log_tail()}")
        return proc, line

    def stop_helpers(self) -> None:
        for proc in self.helpers.values():
            _terminate(proc, grace=5)
        self.helpers = {}

    def stop_workers(self) -> None:
        """SIGTERM every loop-worker; SIGKILL one still holding the bench's
        deliberately endless quiet turns after a grace."""
        if self._environment is not None:
            self._environment.kill_all(signal.SIGTERM, grace=5, kind="loop-worker")

    def check_alive(self) -> None:
        procs = [p.popen for p in self.environment.processes] + list(self.helpers.values())
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"engine process {proc.pid} exited with {proc.returncode}; {self.log_tail()}"
                )

    def log_tail(self, lines: int = 15) -> str:
        if self._environment is None:
            return "(no log output)"
        return self._environment.log_tail(lines=lines) or "(no log output)"

    def stop(self) -> None:
        """Gateway first (SIGTERM), then workers, tool-runners and helpers."""
        if self._environment is not None:
            self._environment.kill_all(signal.SIGTERM, grace=10, kind="gateway")
        self.stop_workers()
        if self._environment is not None:
            self.stop_tool_runners()
        self.stop_helpers()

    def close(self) -> int:
        """Stop everything, delete the Redis keys and drop the database; how many
        keys there were."""
        if self._environment is None:
            return 0
        try:
            self.stop()
            return self._environment.delete_keys()
        finally:
            self._environment.close()
            self._environment = None

    def pids(self) -> dict[str, int]:
        gateway = self.gateway
        out = {"gateway": gateway.pid} if gateway else {}
        workers, runners = self.workers, self.runners
        for i, proc in enumerate(workers):
            out[f"worker{i + 1}" if len(workers) > 1 else "worker"] = proc.pid
        for i, proc in enumerate(runners):
            out[f"runner{i + 1}" if len(runners) > 1 else "runner"] = proc.pid
        for name, helper in self.helpers.items():
            out[name] = helper.pid
        return out


def _terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_quiet(limit_seconds: float, threshold: float = 25.0) -> float:
    """Wait until the machine's busy CPU (all cores, % of one core) over 2 s is
    under ``threshold``, for at most ``limit_seconds``; returns the last reading."""
    deadline = time.monotonic() + limit_seconds
    while True:
        t0 = psutil.cpu_times()
        time.sleep(2)
        t1 = psutil.cpu_times()
        busy = (sum(t1) - t1.idle - sum(t0) + t0.idle) / 2 * 100
        if busy < threshold or time.monotonic() > deadline:
            return busy


def rss(pid: int) -> int:
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


class CpuMeter:
    """CPU use of a set of processes (and this one) over an interval, in % of one core."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.procs["client"] = psutil.Process()
        self._start: dict[str, float] = {}
        self._t0 = 0.0

    @staticmethod
    def _cpu(proc: psutil.Process) -> float:
        try:
            t = proc.cpu_times()
        except psutil.Error:
            return 0.0
        return float(t.user + t.system)

    @staticmethod
    def _machine_busy() -> float:
        t = psutil.cpu_times()
        return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))

    def __enter__(self) -> CpuMeter:
        self._t0 = time.perf_counter()
        self._start = {name: self._cpu(p) for name, p in self.procs.items()}
        self._busy0 = self._machine_busy()
        self.result: dict[str, float] = {}
        self.machine = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        if wall <= 0:
            return
        self.result = {
            name: 100.0 * (self._cpu(p) - self._start[name]) / wall
            for name, p in self.procs.items()
        }
        self.machine = 100.0 * (self._machine_busy() - self._busy0) / wall

    def summary(self) -> str:
        """Per process in % of one core, and what the rest of the machine used
        (PostgreSQL working for the engine, and anything else running)."""
        ours = " ".join(f"{name} {pct:.0f}%" for name, pct in self.result.items())
        rest = self.machine - sum(self.result.values())
        cores = psutil.cpu_count() or 1
        return (
            f"{ours}; rest of machine {max(rest, 0):.0f}% "
            f"(machine {self.machine:.0f}% of {100 * cores}%)"
        )


class PgConnections:
    """Samples how many PostgreSQL connections the bench database has (peak),
    in a thread, while a phase runs; also reads ``max_connections``."""

    def __init__(self, admin_url: str, db_name: str, interval: float = 0.05) -> None:
        self.url = _psycopg_url(admin_url)
        self.db_name = db_name
        self.interval = interval
        self.peak = 0
        self.peak_total = 0
        self.max_connections = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PgConnections:
        self._thread = threading.Thread(target=self._run, name="pg-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                row = conn.execute("SHOW max_connections").fetchone()
                self.max_connections = int(row[0]) if row else 0
                while not self._stop.is_set():
                    row = conn.execute(
                        "SELECT count(*) FILTER (WHERE datname = %s), count(*) "
                        "FROM pg_stat_activity WHERE backend_type = 'client backend'",
                        (self.db_name,),
                    ).fetchone()
                    if row:
                        self.peak = max(self.peak, int(row[0]))
                        self.peak_total = max(self.peak_total, int(row[1]))
                    self._stop.wait(self.interval)
        except psycopg.Error:
            pass  # diagnostics only

    def summary(self) -> str:
        return (
            f"PG connections peak {self.peak} (all databases {self.peak_total}"
            f"/{self.max_connections})"
        )


def redis_server_pid(info: dict[str, object]) -> int | None:
    """The Redis server's pid when it runs on this machine (for the CPU meter)."""
    pid = info.get("process_id")
    try:
        proc = psutil.Process(int(pid))  # type: ignore[arg-type]
    except (psutil.Error, TypeError, ValueError):
        return None
    return proc.pid if "redis" in proc.name() else None
