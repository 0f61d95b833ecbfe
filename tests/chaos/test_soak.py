"""Soak: the chaos cluster at a steady mixed load, with a fault every few seconds, for N minutes.

``--soak-minutes N`` or ``HOLDFAST_CHAOS_SOAK_MINUTES`` (default 5, what CI
runs; ``tests/chaos/conftest.py``). The cluster of ``test_chaos.py`` (its own
Redis, 2 gateways, 3 loop-workers, 2 tool-runners, 2 s leases) takes
:data:`CONCURRENCY` tasks at a time, each 5 turns that stream text deltas,
call ``bash`` (an effect in the workspace) or ask permission first (answered
at once), new tasks replacing finished ones until the time is up. Meanwhile
the driver SIGKILLs a worker every few seconds, a tool-runner or a gateway
now and then, and stalls (SIGSTOP 1-8 s) a runner (a gateway with
``HOLDFAST_CHAOS_STALL_GATEWAYS=1``, a loop-worker with ``HOLDFAST_CHAOS_STALL_WORKERS=1``,
Redis with ``HOLDFAST_CHAOS_STALL_REDIS=1``: see ``driver.stall_kinds``).
Redis is not crashed here (``test_chaos.py`` does that): it stays one
process, so its memory is one series.

One process of each kind is never killed: those are the long-lived ones
whose memory the soak measures (the others are replaced again and again,
each a new series too short to say anything). Every few seconds the RSS
(``VmRSS`` of ``/proc/<pid>/status``) and open file descriptors
(``/proc/<pid>/fd``) of every engine process and Redis, and Redis's
``used_memory``, are sampled.

Reported (``-s``), per window (a minute when N <= 5, else 5 minutes): turns
completed, violations (the chaos invariants, per task, counted in the window
its last turn ended), p99 latency of a text delta (from the event's
timestamp to the client first receiving it, reconnections included). At
start (the first window after the warm-up) and end (the last window): the
memory figures. Asserted: no violation, and each long-lived engine process's
RSS and fd count at the end within :data:`GROWTH` of the start.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from holdfast.testing import time_scale
from tests.chaos.client import TaskClient, Turn
from tests.chaos.cluster import ASKER, ChaosCluster, chaos_env, running_cluster
from tests.chaos.conftest import soak_minutes
from tests.chaos.driver import Driver, Schedule, stall_kinds
from tests.chaos.invariants import check
from tests.chaos.logs import final_logs, superseded_writers

pytestmark = [
    pytest.mark.slow,
]

COUNTS = {"gateway": 2, "worker": 3, "runner": 2}
CONCURRENCY = 8  # tasks at a time: a steady load, not a flood, on 2 cores
TURNS_PER_TASK = 5
TURN_SECONDS = 90.0 * time_scale()  # a liveness bound: a turn not over by then is stuck
SAMPLE_SECONDS = 5.0
# Memory and descriptors at the end may exceed the start by this fraction (the
# issue's "flat within 10 %") ...
GROWTH = 0.10
# ... and descriptors by this many more: most of a gateway's are its clients'
# connections (each client holds at most two at a time), and how the clients
# split between the gateways (one killed or stalled sends them all to the
# other) moves its floor by up to that many; a leak grows past any constant.
FD_SLACK = 2 * CONCURRENCY


def schedule(seconds: float) -> Schedule:
    return Schedule(
        seconds=seconds,
        worker_every=(4.0, 8.0),
        runner_every=(15.0, 25.0),
        gateway_every=(15.0, 25.0),
        redis_crashes_at=(),
        full_restart_window=(math.inf, math.inf),  # never: HITL is answered at once
        redis_outage=(0.0, 0.0),
        counts=COUNTS,
        stall_every=(2.0, 6.0),
        stall_kinds=stall_kinds(),
    )


def task_turns(task_id: str, rng: random.Random) -> list[Turn]:
    turns = []
    for i in range(TURNS_PER_TASK):
        token = f"S{task_id.replace('-', 'x')}x{i}"
        kind = rng.random()
        hitl, tool = kind < 0.15, kind < 0.55
        text, deltas = f"{token} ", rng.randint(20, 40)
        script: dict[str, Any] = {"text": text, "deltas": deltas, "delay_ms": rng.randint(30, 60)}
        if tool:
            command = f"echo {token} >> effects.log; sleep 0.2; echo done $(seq 1 100)"
            script["tool_calls"] = [{"name": "bash", "input": {"command": command}}]
        turns.append(
            Turn(
                task_id=task_id,
                index=i,
                token=token,
                message="/script " + json.dumps(script),
                text=text * deltas,
                tool=tool,
                agent=ASKER if hitl else None,
            )
        )
    return turns


class SoakClient(TaskClient):
    """A task client that also notes when each turn ended and how late each delta came."""

    def __init__(self, *args: Any, t0: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.t0 = t0
        self.ended_at: list[float] = []  # seconds into the soak, per completed turn
        self.delta_latency: list[tuple[float, float]] = []  # (seconds into the soak, ms)

    async def _turn(self, turn: Turn) -> None:
        await super()._turn(turn)
        if turn.outcome == "completed":
            self.ended_at.append(time.monotonic() - self.t0)

    def _take(self, turn: Turn, seq: int, raw: str, data: dict[str, Any]) -> None:
        if data["type"] == "text_delta" and seq not in turn.seen:
            late = time.time() * 1000 - data["timestamp"]
            self.delta_latency.append((time.monotonic() - self.t0, late))
        super()._take(turn, seq, raw, data)


@dataclass
class Sample:
    at: float  # seconds into the soak
    name: str
    pid: int
    rss_kib: int
    fds: int


@dataclass
class Sampler:
    cluster: ChaosCluster
    t0: float
    samples: list[Sample] = field(default_factory=list)
    redis_memory: list[tuple[float, int]] = field(default_factory=list)  # used_memory, bytes

    async def run(self, done: asyncio.Event) -> None:
        redis = Redis.from_url(self.cluster.redis.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            while not done.is_set():
                self.take()
                try:
                    info = await redis.info("memory")
                    self.redis_memory.append((time.monotonic() - self.t0, info["used_memory"]))
                except (RedisError, OSError):
                    pass  # stalled by the driver: no sample this time
                await asyncio.sleep(SAMPLE_SECONDS)  # a sampling period, not a wait for an event
        finally:
            await redis.aclose()

    def take(self) -> None:
        at = time.monotonic() - self.t0
        procs = [(p.name, p.pid) for p in self.cluster.engine.processes if p.alive]
        if self.cluster.redis.pid is not None:
            procs.append(("redis-server", self.cluster.redis.pid))
        for name, pid in procs:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (FileNotFoundError, ProcessLookupError):
                continue  # killed between the listing and the reading
            rss = [int(line.split()[1]) for line in status.splitlines() if line[:6] == "VmRSS:"]
            if rss:  # none: a zombie, killed and not reaped yet
                self.samples.append(Sample(at, name, pid, rss[0], fds))

    def floor(self, pid: int, start: float, end: float) -> tuple[int, int] | None:
        """The lowest RSS and fd count of ``pid`` in [start, end): what it holds when idle.

        A leak raises the floor; requests in flight only raise the peaks.
        """
        mine = [s for s in self.samples if s.pid == pid and start <= s.at < end]
        if not mine:
            return None
        return min(s.rss_kib for s in mine), min(s.fds for s in mine)


def p99(values: list[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@pytest.fixture
async def cluster(database_url: str, tmp_path: Path) -> AsyncIterator[ChaosCluster]:
    env = chaos_env(database_url, tmp_path / "workspaces")
    async with running_cluster(tmp_path, env, **{f"{k}s": n for k, n in COUNTS.items()}) as c:
        yield c


async def test_soak(
    cluster: ChaosCluster,
    api_keys: dict[str, str],
    database_url: str,
    pytestconfig: pytest.Config,
) -> None:
    minutes = soak_minutes(pytestconfig)
    seconds = minutes * 60
    window = 60.0 if minutes <= 5 else 300.0
    warm_up = window  # the first window: pools filled, imports done, caches warm
    seed = int(os.environ.get("HOLDFAST_CHAOS_SEED") or secrets.randbits(32))
    rng = random.Random(seed)
    random.seed(seed)
    key, run = api_keys["main"], secrets.token_hex(3)
    for kind in COUNTS:
        cluster.spared.add(cluster.of(kind)[0].pid)
    driver = Driver(cluster, schedule(seconds), [], seed)
    driver.hitl_gate.set()  # prompts are answered at once; no full restart waits for them

    tasks: dict[str, list[Turn]] = {}
    clients: list[SoakClient] = []
    timeout = httpx.Timeout(connect=3, read=10, write=5, pool=30)
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=30)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        t0 = time.monotonic()
        load_end = t0 + seconds

        async def slot(n: int) -> None:
            k = 0
            while time.monotonic() < load_end:
                task_id = f"soak-{run}-{n:02d}-{k:04d}"
                k += 1
                tasks[task_id] = task_turns(task_id, rng)
                client = SoakClient(
                    http,
                    cluster,
                    key,
                    task_id,
                    tasks[task_id],
                    turn_deadline=TURN_SECONDS,
                    run_deadline=load_end,
                    hangup_chance=0.3,
                    lost_response_chance=0.05,
                    hitl_gate=driver.hitl_gate,
                    on_hitl=driver.on_hitl,
                    t0=t0,
                )
                clients.append(client)
                await client.run()

        sampler = Sampler(cluster, t0)
        done = asyncio.Event()
        background = [
            asyncio.create_task(driver.run(done, t0)),
            asyncio.create_task(sampler.run(done)),
        ]
        try:
            await asyncio.gather(*(slot(n) for n in range(CONCURRENCY)))
        finally:
            done.set()
            await asyncio.gather(*background)
        load_seconds = time.monotonic() - t0
        await driver.supervise()
        await cluster.until_ready()
        logs = await final_logs(http, cluster, key, list(tasks))

    # -- the invariants, per task, each counted in the window its last turn ended
    workspaces = Path(cluster.env["HOLDFAST_WORKSPACE_ROOT"])
    violations: list[tuple[float, str]] = []
    errored = 0
    for client in clients:
        if all(t.outcome == "skipped" for t in client.turns):
            continue  # begun as the time ran out: never sent, nothing to check
        found = await check({client.task_id: client.turns}, logs, workspaces, database_url)
        errored += found.errored_turns
        found.violations += [f"[stream] {m}" for m in client.lookup_violations]
        found.violations += [f"[client] {m}" for t in client.turns for m in t.violations]
        at = max(client.ended_at, default=load_seconds)
        violations += [(at, v) for v in found.violations]

    n_windows = max(1, math.ceil(seconds / window))

    def bucket(at: float) -> int:
        return min(n_windows - 1, int(at // window))

    completed: Counter[int] = Counter(bucket(at) for c in clients for at in c.ended_at)
    broken: Counter[int] = Counter(bucket(at) for at, _ in violations)
    latency: dict[int, list[float]] = defaultdict(list)
    for c in clients:
        for at, ms in c.delta_latency:
            latency[bucket(at)].append(ms)

    # -- memory: the long-lived processes, start (after the warm-up) against end
    start_span = (warm_up, warm_up + window)
    end_span = (max(warm_up, seconds - window), math.inf)
    names = {s.pid: s.name for s in sampler.samples}
    growth: list[str] = []
    rows = []
    for pid, name in sorted(names.items(), key=lambda item: item[1]):
        first, last = sampler.floor(pid, *start_span), sampler.floor(pid, *end_span)
        if first is None or last is None:
            continue  # killed, or started after the warm-up: a short series
        rows.append((name, pid, first, last))
        if name == "redis-server":
            continue  # its memory is the data it holds (reported below), not a leak
        if last[0] > first[0] * (1 + GROWTH):
            growth.append(f"{name}: RSS {first[0]} -> {last[0]} KiB")
        if last[1] > first[1] * (1 + GROWTH) + FD_SLACK:
            growth.append(f"{name}: fds {first[1]} -> {last[1]}")
    used = sampler.redis_memory

    def redis_used(span: tuple[float, float]) -> str:
        values = [b for at, b in used if span[0] <= at < span[1]]
        return f"{min(values) / 2**20:.1f} MiB" if values else "?"

    outcomes = Counter(t.outcome for ts in tasks.values() for t in ts)
    print(f"\n== soak figures ({minutes:g} min, seed {seed}, {os.cpu_count()} CPUs) ==")
    done_turns = outcomes["completed"]
    print(f"  tasks / turns completed / errored: {len(tasks)} / {done_turns} / {errored}")
    print(
        f"  stuck / not started / skipped at the end: "
        f"{outcomes['stuck']} / {outcomes['not_started']} / {outcomes['skipped']}"
    )
    print(
        "  SIGKILL worker / runner / gateway: "
        + " / ".join(str(cluster.kills[k]) for k in ("worker", "runner", "gateway"))
    )
    print(
        "  SIGSTOP worker / runner / gateway / Redis: "
        + " / ".join(str(cluster.stalls[k]) for k in ("worker", "runner", "gateway", "redis"))
    )
    print(f"  stalled workers refused after a takeover: {superseded_writers(cluster)}")
    print(f"  processes that exited on their own: {len(cluster.crashes)}")
    print(f"  load seconds: {load_seconds:.0f}")
    print(f"  {'window':<12} {'turns':>6} {'violations':>10} {'p99 delta ms':>13}")
    for w in range(n_windows):
        span = f"{w * window / 60:g}-{min(seconds, (w + 1) * window) / 60:g} min"
        print(f"  {span:<12} {completed[w]:>6} {broken[w]:>10} {p99(latency[w]):>13.0f}")
    print(f"  memory (floor of the window; start {start_span[0]:g} s, end the last window):")
    for name, pid, (rss0, fd0), (rss1, fd1) in rows:
        print(
            f"    {name:<16} pid {pid:<7} RSS {rss0 / 1024:6.1f} -> {rss1 / 1024:6.1f} MiB"
            f" ({(rss1 - rss0) / rss0:+.1%})   fds {fd0:>3} -> {fd1:>3}"
        )
    print(f"  Redis used_memory: {redis_used(start_span)} -> {redis_used(end_span)}")
    for line in driver.errors + cluster.errors + cluster.crashes:
        print(f"  note: {line}")
    for _, line in violations:
        print(f"  VIOLATION {line}")
    assert not violations, f"{len(violations)} violation(s): {[v for _, v in violations][:5]}"
    assert rows, "no process lived from the warm-up to the end"
    assert not growth, f"grew after the warm-up: {growth}"
