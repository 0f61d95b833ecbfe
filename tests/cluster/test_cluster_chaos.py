"""A shortened chaos run on a Redis Cluster, masters killed under it.

The chaos suite's load (``tests/chaos``: its plan, clients, driver and invariants,
reused), cut to 10 tasks of 3 turns, against 2 gateways, 2 loop-workers and a
tool-runner on the session's cluster of 3 masters and 3 replicas; loop-workers,
gateways and the tool-runner SIGKILLed on the suite's schedule. The driver's
"Redis crash" here SIGKILLs a master: its replica is promoted (``cluster-node-timeout``
1 s), then the killed node starts again and rejoins as a replica. No full restart
(see ``ClusterDriver``): the HITL prompts are answered once they are all out.
Appends WAIT for one replica (``HOLDFAST_REDIS_WAIT_REPLICAS=1``): the invariant
"no acknowledged event lost" needs it across a failover (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from holdfast.testing import NotReady, Process
from holdfast.testing.cluster import RedisClusterServers
from tests.chaos.client import TaskClient, Turn
from tests.chaos.cluster import ASKER, ChaosCluster, chaos_env
from tests.chaos.driver import Driver, Schedule
from tests.chaos.invariants import check, children_of, dump
from tests.chaos.logs import final_logs
from tests.chaos.test_chaos import plan
from tests.processes import engine_from_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TASKS = 10  # the first 4 include the plan's HITL tasks
TURNS_PER_TASK = 3
COUNTS = {"gateway": 2, "worker": 2, "runner": 1}
RUN_SECONDS = 50.0
READY_SECONDS = 90.0
TURN_SECONDS = 90.0
SCHEDULE = Schedule(
    seconds=RUN_SECONDS + TURN_SECONDS,
    worker_every=(4.0, 7.0),
    runner_every=(12.0, 18.0),
    gateway_every=(10.0, 16.0),
    redis_crashes_at=(8.0, 30.0),  # a master SIGKILLed each time
    full_restart_window=(18.0, 40.0),
    redis_outage=(0.5, 1.5),  # before the killed node starts again, as a replica
    counts=COUNTS,
)


@dataclass
class ClusterChaos(ChaosCluster):
    """A :class:`ChaosCluster` whose Redis is a cluster: a crash is a master's."""

    servers: RedisClusterServers | None = None

    async def _until_ready(self, proc: Process) -> None:
        # A busy 2-core machine starts a process in more than the chaos suite's 40 s.
        try:
            await self.engine.until_ready(proc, within=READY_SECONDS)
        except NotReady:
            if proc.alive:
                proc.popen.kill()  # replace_crashed() starts another
                self.errors.append(f"{proc.name} was not ready in {READY_SECONDS:g} s")

    async def restart_redis(self, outage_seconds: float) -> None:
        assert self.servers is not None
        self.kills["redis"] += 1
        dead = await asyncio.to_thread(self.servers.kill_master)
        took = await asyncio.to_thread(self.servers.wait_failover, dead)
        self.errors.append(f"master on port {dead.port} killed; replica promoted in {took:.1f} s")
        await asyncio.sleep(outage_seconds)
        await asyncio.to_thread(self.servers.restart, dead)

    async def full_restart(self) -> None:
        gateways, workers, runners = (len(self.of(k)) for k in ("gateway", "worker", "runner"))
        self.engine.kill_all()
        await self.start_all(gateways, workers, runners)


class ClusterDriver(Driver):
    """The chaos driver without its full restart: the prompts are answered once all
    are out (a full restart of every process costs more than a minute on a busy
    2-core machine; the master kills are what this run is about)."""

    async def _full_restart(self) -> None:
        self.note("every prompt is out: answering them")
        self.hitl_gate.set()


@pytest.fixture
async def chaos(
    redis_cluster: RedisClusterServers, database_url: str, tmp_path: Path
) -> AsyncIterator[ClusterChaos]:
    env = chaos_env(
        database_url,
        tmp_path / "workspaces",
        HOLDFAST_REDIS_WAIT_REPLICAS="1",
        HOLDFAST_REDIS_WAIT_TIMEOUT_MS="500",
    )
    env["HOLDFAST_REDIS_URL"] = redis_cluster.url
    engine = await asyncio.to_thread(engine_from_env, env, tmp_path)
    assert engine.env["HOLDFAST_REDIS_CLUSTER"] == "true"
    cluster = ClusterChaos(engine, servers=redis_cluster)
    try:
        await cluster.start_all(COUNTS["gateway"], COUNTS["worker"], COUNTS["runner"])
        yield cluster
    finally:
        await cluster.stop()
        print(f"\nprocess logs: {engine.log_dir}")


async def test_chaos_on_a_cluster_with_masters_killed(
    chaos: ClusterChaos, api_keys: dict[str, str], database_url: str
) -> None:
    seed = int(os.environ.get("HOLDFAST_CHAOS_SEED") or secrets.randbits(32))
    rng = random.Random(seed)
    random.seed(seed)
    key = api_keys["main"]
    planned = plan(secrets.token_hex(3), rng)
    tasks = {t: turns[:TURNS_PER_TASK] for t, turns in list(planned.items())[:TASKS]}
    turns = [t for ts in tasks.values() for t in ts]
    hitl: list[Turn] = [t for t in turns if t.agent == ASKER]
    driver = ClusterDriver(chaos, SCHEDULE, hitl, seed)

    timeout = httpx.Timeout(connect=3, read=10, write=5, pool=30)
    async with httpx.AsyncClient(timeout=timeout) as http:
        t0 = time.monotonic()
        clients = [
            TaskClient(
                http,
                chaos,
                key,
                task_id,
                task_turns,
                turn_deadline=TURN_SECONDS,
                run_deadline=t0 + RUN_SECONDS,
                hangup_chance=0.3,
                lost_response_chance=0.08,
                hitl_gate=driver.hitl_gate,
                on_hitl=driver.on_hitl,
            )
            for task_id, task_turns in tasks.items()
        ]
        done = asyncio.Event()
        driving = asyncio.create_task(driver.run(done, t0))
        try:
            await asyncio.gather(*(c.run() for c in clients))
        finally:
            done.set()
            await driving
        await driver.supervise()
        await chaos.until_ready()
        assert chaos.servers is not None
        url = chaos.servers.url
        logs = await final_logs(http, chaos, key, list(tasks), redis_cluster_url=url)
        children = await final_logs(http, chaos, key, children_of(logs), redis_cluster_url=url)

    workspaces = Path(chaos.env["HOLDFAST_WORKSPACE_ROOT"])
    found = await check(tasks, logs, workspaces, database_url, children)
    for client in clients:
        for message in client.lookup_violations:
            found.add("stream", message)
    for turn in turns:
        for message in turn.violations:
            found.add("client", message)
    outcomes = Counter(t.outcome for t in turns)
    print(f"\n== cluster chaos (seed {seed}) ==")
    print(f"  outcomes {dict(outcomes)}; errored {found.errored_turns}")
    print(f"  events {sum(len(v) for v in logs.values())}; kills {dict(chaos.kills)}")
    print(f"  masters killed {driver.redis_crashes}")
    for line in driver.timeline + driver.errors + chaos.errors + chaos.crashes:
        print(f"  {line}")
    for line in found.violations:
        print(f"  VIOLATION {line}")
    if found.violations:
        await dump(chaos.log_dir / "final", logs, list(tasks), database_url)
    assert driver.redis_crashes >= 1, "no master was killed during the run"
    assert outcomes["skipped"] <= len(turns) // 10, f"turns never sent: {outcomes}"
    assert not found.violations, f"{len(found.violations)} violation(s): {found.violations[:5]}"
