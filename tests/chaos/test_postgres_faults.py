"""PostgreSQL faults under a load of streaming turns (issue #29).

The engine (real processes: 2 gateways, 2 loop-workers, a tool-runner, its own
Redis) runs on a PostgreSQL of this module's own (``pgserver.OwnPostgres``),
never the machine's. While chaos clients (``client.py``: one turn at a time
per task, reconnecting by seq) stream scripted turns, some calling ``bash``,
each test inflicts one fault:

* a fast restart (``pg_ctl -m fast`` stop, start at once);
* a restart after 30 s down;
* the whole server frozen (SIGSTOP of the postmaster and its backends) for
  5-20 s, then SIGCONT;
* every engine connection killed (``pg_terminate_backend``) twice a second
  for 6 s;
* INSERTs into ``events`` refused with SQLSTATE 53100 ``disk_full`` for 8 s;
* and where a long outage leads: Redis at its ``maxmemory`` for 6 s.

Meanwhile a probe POSTs a short turn every second. What must hold: the chaos
invariants (``invariants.py``: one ending per turn, gapless logs identical in
Redis, in PostgreSQL and in what each client saw, tools run once, messages
stored once), except that a turn may end ``errored`` when its error names a
code a client can act on; each task takes its next message; every probe is
answered within the request timeout and a bit, 200 or 503 ``UNAVAILABLE``
with ``Retry-After`` (never a hang, never a 500); the archiver catches up.
Printed (``-s``): how long after the server is back new turns start again
(the probes) and the archive is whole (the recovery times in
docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from holdfast_shared.keys import Keys
from redis.asyncio import Redis

from holdfast.testing import create_database, drop_database, scaled, time_scale
from tests.chaos.client import TaskClient, Turn
from tests.chaos.cluster import ChaosCluster, chaos_env, running_cluster
from tests.chaos.invariants import check, dump, engine_tasks
from tests.chaos.logs import final_logs
from tests.chaos.pgserver import OwnPostgres
from tests.isolation import session_keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

TASKS = 6
TURNS_PER_TASK = 3
REQUEST_TIMEOUT = 3  # HOLDFAST_REQUEST_TIMEOUT_SECONDS of the gateways
# A probe's answer may take the request timeout, plus a loaded machine's slack.
ANSWER_WITHIN = REQUEST_TIMEOUT + scaled(7)
FAULT_AFTER = 3.0  # seconds into the load: every task is streaming by then
TURN_SECONDS = 150.0 * time_scale()
# An errored turn must say why in a code a client can act on: a store that
# refused its writes (a full disk) ends it UNAVAILABLE.
CLEAR_CODES = {"UNAVAILABLE"}


@pytest.fixture(scope="module")
def own_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnPostgres]:
    server = OwnPostgres(tmp_path_factory.mktemp("pgfaults") / "pg")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def database_url(own_postgres: OwnPostgres) -> Iterator[str]:
    url = create_database(own_postgres.admin_url, "pgfaults")
    yield url
    with contextlib.suppress(Exception):
        drop_database(own_postgres.admin_url, "pgfaults")


@pytest.fixture(scope="module")
def api_keys(database_url: str) -> dict[str, str]:
    return session_keys(database_url)


@pytest.fixture(scope="module")
async def cluster(
    database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ChaosCluster]:
    tmp = tmp_path_factory.mktemp("pgfaults-engine")
    env = chaos_env(
        database_url,
        tmp / "workspaces",
        HOLDFAST_REQUEST_TIMEOUT_SECONDS=str(REQUEST_TIMEOUT),
        # The default 2 s lease of the chaos suite: a frozen PostgreSQL cannot
        # renew leases, and cannot hand them to anyone else either.
    )
    async with running_cluster(tmp, env, gateways=2, workers=2, runners=1) as c:
        yield c


@pytest.fixture(autouse=True)
def healed(own_postgres: OwnPostgres) -> Iterator[None]:
    """Whatever a failed test left: the server running and not frozen."""
    yield
    with contextlib.suppress(Exception):
        own_postgres.thaw()
    if not own_postgres.server.running():
        own_postgres.start()


def plan(rng: random.Random) -> dict[str, list[Turn]]:
    run = secrets.token_hex(3)
    tasks: dict[str, list[Turn]] = {}
    for t in range(TASKS):
        task_id = f"pgf-{run}-{t}"
        turns = []
        for i in range(TURNS_PER_TASK):
            token = f"P{run}x{t}x{i}"
            tool = rng.random() < 0.3
            deltas = rng.randint(30, 50)
            script: dict[str, Any] = {"text": f"{token} ", "deltas": deltas, "delay_ms": 50}
            if tool:
                command = f"echo {token} >> effects.log; echo done $(seq 1 40)"
                script["tool_calls"] = [{"name": "bash", "input": {"command": command}}]
            message = "/script " + json.dumps(script)
            turns.append(Turn(task_id, i, token, message, f"{token} " * deltas, tool))
        tasks[task_id] = turns
    return tasks


@dataclass
class Probe:
    """What one POST /execute got while the fault ran."""

    sent: float
    took: float
    status: int | None
    error: str | None = None
    retry_after: str | None = None


@dataclass
class Probing:
    probes: list[Probe] = field(default_factory=list)

    async def run(self, http: httpx.AsyncClient, cluster: ChaosCluster, key: str) -> None:
        while True:
            url = cluster.pick_gateway()
            if url is not None:
                await self._one(http, url, key)
            await asyncio.sleep(1.0)

    async def _one(self, http: httpx.AsyncClient, url: str, key: str) -> None:
        body = {"message": "/script " + json.dumps({"text": "p", "deltas": 1}),
                "task_id": f"probe-{secrets.token_hex(4)}"}  # fmt: skip
        sent = time.monotonic()
        try:
            async with (
                asyncio.timeout(ANSWER_WITHIN + 30),
                http.stream(
                    "POST", f"{url}/execute", json=body, headers={"X-Engine-Key": key}
                ) as response,
            ):
                probe = Probe(sent, time.monotonic() - sent, response.status_code)
                if response.status_code != 200:
                    await response.aread()
                    probe.error = response.json().get("error")
                    probe.retry_after = response.headers.get("retry-after")
        except (httpx.HTTPError, TimeoutError) as exc:
            probe = Probe(sent, time.monotonic() - sent, None, error=repr(exc))
        self.probes.append(probe)

    def first_ok_after(self, moment: float) -> float | None:
        """Seconds from ``moment`` until a probe sent after it was answered 200."""
        oks = [p.sent + p.took for p in self.probes if p.sent >= moment and p.status == 200]
        return min(oks) - moment if oks else None


async def archived_after(
    cluster: ChaosCluster, database_url: str, names: list[str], moment: float
) -> float:
    """Seconds from ``moment`` until PostgreSQL holds every event the tasks had
    in Redis when this was called (the archive watermark reached it)."""
    ids = [task for _, task in (await engine_tasks(database_url, names)).values()]
    keys = Keys(cluster.env["HOLDFAST_REDIS_PREFIX"])
    redis = Redis.from_url(cluster.redis.url, decode_responses=True)
    try:
        wanted = {}
        for task in ids:
            last = await redis.xrevrange(keys.events(task), count=1)
            wanted[task] = int(last[0][0].split("-")[0]) if last else 0
        deadline = time.monotonic() + scaled(120)
        while True:
            marks = [await redis.get(keys.archived(task)) for task in ids]
            if all(int(m or 0) >= wanted[t] for m, t in zip(marks, ids, strict=True)):
                return time.monotonic() - moment
            assert time.monotonic() < deadline, f"the archive never caught up: {marks} {wanted}"
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()


async def bytes_per_event(cluster: ChaosCluster, database_url: str, names: list[str]) -> float:
    """Redis memory per logged event of the tasks (their event streams, MEMORY USAGE)."""
    ids = [task for _, task in (await engine_tasks(database_url, names)).values()]
    keys = Keys(cluster.env["HOLDFAST_REDIS_PREFIX"])
    redis = Redis.from_url(cluster.redis.url, decode_responses=True)
    try:
        used = events = 0
        for task in ids:
            used += int(await redis.memory_usage(keys.events(task), samples=0) or 0)
            events += int(await redis.xlen(keys.events(task)))
    finally:
        await redis.aclose()
    return used / max(events, 1)


async def under_fault(
    cluster: ChaosCluster,
    key: str,
    database_url: str,
    fault: Callable[[], Awaitable[float]],
    *,
    name: str,
    expect_503: bool,
) -> None:
    """Run the load, inflict ``fault`` (which returns the moment the server is
    whole again) after FAULT_AFTER seconds, then check everything."""
    rng = random.Random()
    tasks = plan(rng)
    turns = [t for ts in tasks.values() for t in ts]
    timeout = httpx.Timeout(connect=3, read=10, write=5, pool=30)
    gate = asyncio.Event()
    gate.set()
    probing = Probing()
    async with httpx.AsyncClient(timeout=timeout) as http:
        t0 = time.monotonic()
        clients = [
            TaskClient(http, cluster, key, task_id, task_turns,
                       turn_deadline=TURN_SECONDS, run_deadline=t0 + 90,
                       hangup_chance=0.2, lost_response_chance=0.0,
                       hitl_gate=gate, on_hitl=lambda _turn: None)
            for task_id, task_turns in tasks.items()
        ]  # fmt: skip
        load = asyncio.gather(*(c.run() for c in clients))
        probes = asyncio.create_task(probing.run(http, cluster, key))
        await asyncio.sleep(FAULT_AFTER)
        faulted = time.monotonic()
        whole = await fault()
        fault_seconds = whole - faulted
        archived = await archived_after(cluster, database_url, list(tasks), whole)
        try:
            await load
        finally:
            # A few probes after the load: new turns start again.
            until = time.monotonic() + scaled(60)
            while probing.first_ok_after(whole) is None and time.monotonic() < until:  # noqa: ASYNC110
                await asyncio.sleep(0.5)
            probes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probes
        restarted = await cluster.replace_crashed()
        await cluster.until_ready()
        logs = await final_logs(http, cluster, key, list(tasks))
    memory = await bytes_per_event(cluster, database_url, list(tasks))

    workspaces = Path(cluster.env["HOLDFAST_WORKSPACE_ROOT"])
    found = await check(tasks, logs, workspaces, database_url)
    errored_ids = {t.turn_id for t in turns if t.outcome == "errored"}
    violations = [
        v
        for v in found.violations
        if not v.startswith("[errored]")
        # A turn that ended errored before its tool ran has no tool result.
        and not (v.startswith("[tools]") and v.split()[1] in errored_ids and "0 tool" in v)
    ]
    errored = [v for v in found.violations if v.startswith("[errored]")]
    for message in errored:
        code = message.split(": ", 2)[1]
        if code not in CLEAR_CODES:
            violations.append(f"an errored turn without a clear code: {message}")
    for client in clients:
        violations += client.lookup_violations
    for turn in turns:
        violations += turn.violations
    outcomes = Counter(t.outcome for t in turns)
    if outcomes["skipped"]:
        violations.append(f"{outcomes['skipped']} turns never sent (a task refused messages?)")
    for p in probing.probes:
        if p.status is None or p.took > ANSWER_WITHIN:
            violations.append(f"probe at +{p.sent - t0:.1f} s: {p.status} after {p.took:.1f} s")
        elif p.status != 200 and not (
            p.status == 503 and p.error == "UNAVAILABLE" and p.retry_after
        ):
            violations.append(f"probe at +{p.sent - t0:.1f} s: {p.status} {p.error}")
    statuses = Counter(p.status for p in probing.probes)
    if expect_503 and not statuses[503]:
        violations.append("no probe saw 503 UNAVAILABLE while PostgreSQL was out")
    resumed = probing.first_ok_after(whole)
    print(f"\n== {name} ==")
    codes = Counter(message.split(": ", 2)[1] for message in errored)
    print(f"  fault lasted {fault_seconds:.1f} s; turns {dict(outcomes)}, errored {dict(codes)}")
    print(f"  turns resumed / turn_resumed events {found.resumed_turns} / {found.resumed_events}")
    print(f"  probes {dict(statuses)}; slowest answer {max(p.took for p in probing.probes):.1f} s")
    print(f"  RECOVERY {name}: new turns {resumed if resumed is None else round(resumed, 1)} s, "
          f"archive whole {archived:.1f} s after the server was back")  # fmt: skip
    print(f"  events {sum(len(v) for v in logs.values())}, {memory:.0f} bytes each in Redis; "
          f"processes restarted {restarted}")  # fmt: skip
    if violations:
        await dump(cluster.log_dir / f"final-{name}", logs, list(tasks), database_url)
        print(f"  evidence: {cluster.log_dir / f'final-{name}'}")
    assert not violations, f"{len(violations)} violation(s): {violations[:8]}"
    assert resumed is not None, "no new turn started after the fault"
    assert not restarted, f"processes died under the fault: {restarted}"


async def test_fast_restart(
    cluster: ChaosCluster, own_postgres: OwnPostgres, api_keys: dict[str, str], database_url: str
) -> None:
    async def fault() -> float:
        await own_postgres.restart()
        return time.monotonic()

    await under_fault(cluster, api_keys["main"], database_url, fault,
                      name="restart", expect_503=False)  # fmt: skip


async def test_restart_after_30_seconds_down(
    cluster: ChaosCluster, own_postgres: OwnPostgres, api_keys: dict[str, str], database_url: str
) -> None:
    async def fault() -> float:
        await own_postgres.restart(down_seconds=30)
        return time.monotonic()

    await under_fault(cluster, api_keys["main"], database_url, fault,
                      name="down 30 s", expect_503=True)  # fmt: skip


async def test_frozen_server(
    cluster: ChaosCluster, own_postgres: OwnPostgres, api_keys: dict[str, str], database_url: str
) -> None:
    stalled = random.uniform(5, 20)

    async def fault() -> float:
        own_postgres.freeze()
        try:
            await asyncio.sleep(stalled)
        finally:
            own_postgres.thaw()
        return time.monotonic()

    await under_fault(cluster, api_keys["main"], database_url, fault,
                      name=f"SIGSTOP {stalled:.0f} s", expect_503=True)  # fmt: skip


async def test_connections_terminated_again_and_again(
    cluster: ChaosCluster, own_postgres: OwnPostgres, api_keys: dict[str, str], database_url: str
) -> None:
    terminated: list[int] = []

    async def fault() -> float:
        for _ in range(12):
            terminated.append(await own_postgres.terminate_backends(database_url))
            await asyncio.sleep(0.5)
        return time.monotonic()

    await under_fault(cluster, api_keys["main"], database_url, fault,
                      name="pg_terminate_backend", expect_503=False)  # fmt: skip
    assert sum(terminated) > 0, "the engine had no connection to terminate"


async def test_events_table_refusing_writes(
    cluster: ChaosCluster, own_postgres: OwnPostgres, api_keys: dict[str, str], database_url: str
) -> None:
    async def fault() -> float:
        await own_postgres.refuse_event_inserts(database_url, True)
        try:
            await asyncio.sleep(8)
        finally:
            await own_postgres.refuse_event_inserts(database_url, False)
        return time.monotonic()

    await under_fault(cluster, api_keys["main"], database_url, fault,
                      name="disk full (events)", expect_503=False)  # fmt: skip


async def test_redis_full(
    cluster: ChaosCluster, api_keys: dict[str, str], database_url: str
) -> None:
    """Not PostgreSQL's fault, but where a long outage of it leads: Redis at its
    ``maxmemory`` (``noeviction``) refuses every write for 6 s. Held at the
    memory of the moment, Redis takes a write now and then (expiries free a
    little), so a probe may not meet the refusal: a 503 is not required, a 500
    is a violation."""

    async def fault() -> float:
        redis = Redis.from_url(cluster.redis.url, decode_responses=True)
        try:
            used = (await redis.info("memory"))["used_memory"]
            await redis.config_set("maxmemory", str(used))
            await asyncio.sleep(6)
        finally:
            await redis.config_set("maxmemory", "0")
            await redis.aclose()
        return time.monotonic()

    await under_fault(cluster, api_keys["main"], database_url, fault,
                      name="Redis full", expect_503=False)  # fmt: skip
