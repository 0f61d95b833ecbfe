"""The bench's own engine: a fresh database, a private Redis prefix, real processes.

Nothing here is shared with a running engine: the database ``hfbench_<hex>``
is created and dropped (``WITH (FORCE)``), every Redis key lives under
``hfbench:<hex>:`` and is deleted at the end, and the processes are the
bench's own children, stopped by pid.
"""

from __future__ import annotations

import asyncio
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import psycopg
from sqlalchemy.engine import make_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
REPO_ROOT = str(Path(__file__).resolve().parent.parent)
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432"


def redis_url() -> str:
    return os.environ.get("HOLDFAST_BENCH_REDIS_URL", DEFAULT_REDIS_URL)


def admin_database_url() -> str:
    return os.environ.get("HOLDFAST_BENCH_DATABASE_URL", DEFAULT_DATABASE_URL)


def _with_database(url: str, name: str) -> str:
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def _psycopg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def raise_nofile(wanted: int) -> int:
    """Raise the soft open-files limit (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Engine:
    """A database, a Redis prefix, an API key, and the engine's processes."""

    redis_url: str
    admin_url: str
    heartbeat_seconds: float
    worker_concurrency: int
    run_id: str = field(default_factory=lambda: secrets.token_hex(4))
    api_key: str = field(default_factory=lambda: f"hf_bench_{secrets.token_hex(16)}")
    gateway: subprocess.Popen[bytes] | None = None
    gateway_url: str = ""
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # Tool-runners and helper processes (the fake provider server), stopped with the rest.
    runners: list[subprocess.Popen[bytes]] = field(default_factory=list)
    helpers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    log_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="hfbench-")))
    _db_created: bool = False
    _worker_seq: int = 0

    @property
    def prefix(self) -> str:
        return f"hfbench:{self.run_id}:"

    @property
    def db_name(self) -> str:
        return f"hfbench_{self.run_id}"

    @property
    def database_url(self) -> str:
        return _with_database(self.admin_url, self.db_name)

    # -- database --------------------------------------------------------------
    def create_database(self) -> None:
        from holdfast_shared.db import upgrade_head

        with psycopg.connect(_psycopg_url(self.admin_url), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.db_name}"')
        self._db_created = True
        upgrade_head(self.database_url)

        async def add() -> None:
            from holdfast_shared.db import create_engine, session_factory
            from holdfast_shared.tenancy import add_key

            engine = create_engine(self.database_url, pool_size=1)
            try:
                async with session_factory(engine).begin() as session:
                    await add_key(session, "tenant-bench", self.api_key)
            finally:
                await engine.dispose()

        asyncio.run(add())

    def drop_database(self) -> None:
        if not self._db_created:
            return
        with psycopg.connect(_psycopg_url(self.admin_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
        self._db_created = False

    async def delete_redis_keys(self) -> int:
        from holdfast_shared.redisconn import connect

        client = connect(self.redis_url)
        deleted = 0
        try:
            batch: list[str] = []
            async for key in client.scan_iter(match=f"{self.prefix}*", count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += await client.delete(*batch)
                    batch = []
            if batch:
                deleted += await client.delete(*batch)
        finally:
            await client.aclose()
        return deleted

    # -- processes -------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")}
        env.update(
            HOLDFAST_REDIS_URL=self.redis_url,
            HOLDFAST_DATABASE_URL=self.database_url,
            HOLDFAST_REDIS_PREFIX=self.prefix,
            HOLDFAST_HEARTBEAT_SECONDS=str(self.heartbeat_seconds),
            HOLDFAST_MODEL="scripted",
            HOLDFAST_LOG_LEVEL="WARNING",
            HOLDFAST_WORKER_CONCURRENCY=str(self.worker_concurrency),
        )
        env.update(extra)
        return env

    def _spawn(
        self,
        module: str,
        env: dict[str, str],
        log_name: str,
        code: str | None = None,
        stdout: int | None = None,
    ) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / log_name, "ab")  # the child keeps it open
        if code is not None:
            # Bench code run inside an engine process (bench.instrument, the fake
            # provider) is imported from the repository root.
            path = os.pathsep.join(filter(None, (REPO_ROOT, env.get("PYTHONPATH"))))
            env = {**env, "PYTHONPATH": path}
        return subprocess.Popen(
            [sys.executable, "-c", code or f"from {module}.main import main; main()"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log if stdout is None else stdout,
            stderr=log if stdout is not None else subprocess.STDOUT,
            cwd=REPO_ROOT,
        )

    def start_gateway(
        self, code: str | None = None, extra_env: dict[str, str] | None = None
    ) -> str:
        port = free_port()
        env = self.env(HOLDFAST_PORT=str(port), HOLDFAST_HOST="127.0.0.1", **(extra_env or {}))
        proc = self._spawn("holdfast_gateway", env, "gateway.log", code)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}; {self.log_tail()}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"gateway not healthy in 30 s; {self.log_tail()}")
            time.sleep(0.1)
        self.gateway, self.gateway_url = proc, url
        return url

    def start_worker(
        self,
        concurrency: int | None = None,
        extra_env: dict[str, str] | None = None,
        code: str | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a loop-worker (``code``: another entry point, e.g. an instrumented one)."""
        extra = {} if concurrency is None else {"HOLDFAST_WORKER_CONCURRENCY": str(concurrency)}
        extra.update(extra_env or {})
        self._worker_seq += 1
        proc = self._spawn(
            "holdfast_loop_worker", self.env(**extra), f"worker{self._worker_seq}.log", code
        )
        self.workers.append(proc)
        return proc

    def set_workers(
        self,
        count: int,
        concurrency: int,
        extra_env: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        """Replace the running loop-workers by ``count`` new ones and wait until
        each has joined the turns consumer group."""
        self.stop_workers()
        procs = [self.start_worker(concurrency, extra_env, code) for _ in range(count)]
        asyncio.run(self.wait_consumers(procs))

    def kill_worker(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL one loop-worker (a crash, as far as the engine can tell)."""
        proc.kill()
        proc.wait()
        self.workers.remove(proc)

    def start_tool_runner(
        self, extra_env: dict[str, str] | None = None, code: str | None = None
    ) -> subprocess.Popen[bytes]:
        proc = self._spawn(
            "holdfast_tool_runner",
            self.env(**(extra_env or {})),
            f"tool-runner{len(self.runners) + 1}.log",
            code,
        )
        self.runners.append(proc)
        asyncio.run(self.wait_consumers([proc], what="tool-runner"))
        return proc

    def stop_tool_runners(self) -> None:
        for proc in self.runners:
            _terminate(proc, grace=10)
        self.runners = []

    def start_helper(
        self, name: str, code: str, extra_env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], str]:
        """Start a bench helper process (``code``) that prints one line, e.g. its URL,
        when it is ready; returns the process and that line."""
        proc = self._spawn(
            "", self.env(**(extra_env or {})), f"{name}.log", code, stdout=subprocess.PIPE
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

    async def wait_consumers(
        self, procs: list[subprocess.Popen[bytes]], what: str = "loop-workers"
    ) -> None:
        """Wait until every worker sits in a blocking XREADGROUP (found by matching
        CLIENT LIST addresses to the worker's own sockets; a consumer shows in
        XINFO CONSUMERS only once it was handed a job)."""
        from holdfast_shared.redisconn import connect

        client = connect(self.redis_url)
        deadline = time.monotonic() + 60
        try:
            while True:
                self.check_alive()
                blocked = {
                    c.get("addr", "").rsplit(":", 1)[-1]
                    for c in await client.client_list()
                    if c.get("cmd") == "xreadgroup"
                }
                ready = 0
                for proc in procs:
                    try:
                        conns = psutil.Process(proc.pid).net_connections("tcp")
                    except psutil.Error:
                        conns = []
                    ports = {str(c.laddr.port) for c in conns if c.raddr}
                    if not conns and time.monotonic() > deadline - 50:
                        ready += 1  # Redis over a unix socket: give it 10 s, then go on
                    elif ports & blocked:
                        ready += 1
                if ready == len(procs):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not start in 60 s; {self.log_tail()}")
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    def stop_workers(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.workers:
            _wait_or_kill(proc, grace=5)
        self.workers = []

    def check_alive(self) -> None:
        for proc in [self.gateway, *self.workers, *self.runners, *self.helpers.values()]:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"engine process {proc.pid} exited with {proc.returncode}; {self.log_tail()}"
                )

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            if text:
                out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out) or "(no log output)"

    def stop(self) -> None:
        """Gateway first (SIGTERM), then workers; a worker still holding the
        bench's deliberately endless quiet turns gets SIGKILL after a grace."""
        if self.gateway is not None:
            _terminate(self.gateway, grace=10)
        self.stop_workers()
        self.stop_tool_runners()
        self.stop_helpers()

    def pids(self) -> dict[str, int]:
        out = {"gateway": self.gateway.pid} if self.gateway else {}
        for i, proc in enumerate(self.workers):
            out[f"worker{i + 1}" if len(self.workers) > 1 else "worker"] = proc.pid
        for i, proc in enumerate(self.runners):
            out[f"runner{i + 1}" if len(self.runners) > 1 else "runner"] = proc.pid
        for name, proc in self.helpers.items():
            out[name] = proc.pid
        return out


def _terminate(proc: subprocess.Popen[bytes], grace: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _wait_or_kill(proc, grace)


def _wait_or_kill(proc: subprocess.Popen[bytes], grace: float) -> None:
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
