"""A whole engine the chaos test may kill: ``holdfast.testing``'s environment, its own Redis.

The environment runs Redis (``redis-server`` with AOF, ``appendfsync
always``, restarted on the same port and directory, so a SIGKILL loses
nothing acknowledged: "Redis restarts" here means crash and restart, not
data loss) and the services as ``python -m holdfast <service>``, each
writing its own log for the post-mortem; it says when one is ready. Here:
what a chaos run adds — kinds by short name, kills counted, random victims,
replacements not waited for, crashes found and replaced as a supervisor would.

All waiting is async: the chaos clients share the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from holdfast.testing import EngineEnvironment, Kind, NotReady, Process, RedisServer, time_scale
from tests.conftest import engine_env
from tests.processes import engine_from_env

READY_SECONDS = 40.0 * time_scale()  # on an idle machine; scaled to this one

# The chaos suite's names for the kinds (schedules, counters, reports).
KINDS: dict[str, Kind] = {"gateway": "gateway", "worker": "loop-worker", "runner": "tool-runner"}
SHORT = {kind: short for short, kind in KINDS.items()}


@dataclass
class ChaosCluster:
    """Gateways, loop-workers and tool-runners against one restartable Redis."""

    engine: EngineEnvironment
    kills: Counter[str] = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)  # processes that died on their own
    errors: list[str] = field(default_factory=list)
    stalls: Counter[str] = field(default_factory=Counter)  # SIGSTOPs, by kind
    spared: set[int] = field(default_factory=set)  # pids kill_and_replace never picks
    _starting: set[asyncio.Task[None]] = field(default_factory=set)
    _stopped: dict[int, str] = field(default_factory=dict)  # pid -> name, SIGSTOPped now

    @property
    def env(self) -> dict[str, str]:
        return self.engine.env

    @property
    def log_dir(self) -> Path:
        return self.engine.log_dir

    @property
    def redis(self) -> RedisServer:
        assert self.engine.redis is not None
        return self.engine.redis

    # -- starting --------------------------------------------------------------
    async def start(self, kind: str, *, wait: bool = True) -> Process:
        """Start one process; with ``wait``, return once it is ready.

        Without ``wait`` the process counts at once (clients pick a gateway
        only once it is ready); one that dies while starting is found by
        :meth:`replace_crashed`.
        """
        proc = self.engine.start(KINDS[kind], wait=False)
        waiting = asyncio.create_task(self._until_ready(proc))
        self._starting.add(waiting)
        waiting.add_done_callback(self._starting.discard)
        if wait:
            await waiting
        return proc

    async def _until_ready(self, proc: Process) -> None:
        try:
            await self.engine.until_ready(proc, within=READY_SECONDS)
        except NotReady:
            if proc.alive:
                proc.popen.kill()  # replace_crashed() starts another
                self.errors.append(f"{proc.name} was not ready in {READY_SECONDS:g} s")
            # else replace_crashed() notices it

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
    def of(self, kind: str) -> list[Process]:
        return self.engine.of(KINDS[kind])

    def gateway_urls(self) -> list[str]:
        return [p.url for p in self.of("gateway") if p.url and p.ready and p.alive]

    def pick_gateway(self) -> str | None:
        urls = self.gateway_urls()
        return random.choice(urls) if urls else None

    # -- stalling --------------------------------------------------------------
    def stall(self, kind: str) -> int | None:
        """SIGSTOP a random live process of ``kind`` (or ``redis``); its pid, or None.

        The caller owes it a :meth:`wake`; a kill or restart of it wakes it
        first, so nothing is ever left stopped.
        """
        if kind == "redis":
            pid, name = self.redis.pid, "redis-server"
        else:
            alive = [p for p in self.of(kind) if p.alive]
            proc = random.choice(alive) if alive else None
            pid, name = (proc.pid, proc.name) if proc else (None, "")
        if pid is None or self._stopped:  # one stall at a time
            return None
        os.kill(pid, signal.SIGSTOP)
        self._stopped[pid] = name
        self.stalls[kind] += 1
        return pid

    def wake(self, pid: int | None = None) -> None:
        """SIGCONT ``pid`` (every stopped process when None), if it is still stopped by us.

        Only pids still in the table are signalled: one killed since was
        woken then and forgotten, and its pid may belong to another process now.
        """
        for stopped in [pid] if pid is not None else list(self._stopped):
            if self._stopped.pop(stopped, None) is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stopped, signal.SIGCONT)

    def stopped_name(self, pid: int) -> str:
        return self._stopped.get(pid, "?")

    # -- killing ---------------------------------------------------------------
    async def kill(self, proc: Process, *, count: bool = True) -> None:
        self.wake(proc.pid)  # out of the stopped table before its pid can be reused
        self.engine.kill(proc)  # SIGKILL and reap: a moment
        if count:
            self.kills[SHORT[proc.kind]] += 1

    async def kill_and_replace(self, kind: str) -> bool:
        """SIGKILL a random ready process of ``kind`` and start its replacement (not waited for).

        Skipped while fewer than two are ready: the run kills processes, it
        does not starve the engine of a kind altogether (a full restart does
        that, on purpose, once).
        """
        ready = [p for p in self.of(kind) if p.ready and p.alive]
        victims = [p for p in ready if p.pid not in self.spared]
        if len(ready) < 2 or not victims:
            return False
        await self.kill(random.choice(victims))
        await self.start(kind, wait=False)
        return True

    async def restart_redis(self, outage_seconds: float) -> None:
        self.wake()
        self.kills["redis"] += 1
        await asyncio.to_thread(self.engine.restart_redis, outage_seconds)

    async def full_restart(self) -> None:
        """SIGKILL every engine process and Redis at once, then start everything again."""
        gateways, workers, runners = (len(self.of(k)) for k in ("gateway", "worker", "runner"))
        self.wake()
        self.engine.kill_all()
        await asyncio.to_thread(self.engine.restart_redis)
        await self.start_all(gateways, workers, runners)

    async def replace_crashed(self) -> list[str]:
        """Act as the supervisor would: restart processes that exited on their own."""
        found = []
        for proc in self.engine.processes:
            code = proc.popen.poll()
            if code is not None:
                found.append(f"{proc.name} exited with {code}")
                self.wake(proc.pid)
                self.engine.kill(proc)  # gone already: only forgotten
                await self.start(SHORT[proc.kind], wait=False)
        self.crashes += found
        return found

    def owner(self, lease_owner: str) -> Process | None:
        """The loop-worker whose lease name (``<host>-<pid>``) this is."""
        return next((p for p in self.of("worker") if p.ident == lease_owner), None)

    async def stop(self) -> None:
        self.wake()
        for task in self._starting:
            task.cancel()
        await asyncio.to_thread(self.engine.close)


ASKER = "coder"  # the (built-in) agent whose bash calls ask for permission


def chaos_env(database_url: str, workspaces: Path, **extra: str) -> dict[str, str]:
    """The engine environment of these tests: 2 s leases, bash allowed except for ``coder``."""
    workspaces.mkdir(mode=0o700, exist_ok=True)
    return engine_env(
        "",  # none: the cluster runs its own Redis
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

    ``env`` is the engine environment; its Redis URL is ignored: the cluster
    runs its own Redis.
    """
    own_redis = {k: v for k, v in env.items() if k != "HOLDFAST_REDIS_URL"}
    engine = await asyncio.to_thread(engine_from_env, own_redis, tmp)
    cluster = ChaosCluster(engine)
    try:
        await cluster.start_all(gateways, workers, runners)
        yield cluster
    finally:
        await cluster.stop()
        print(f"\nprocess logs: {engine.log_dir}")
