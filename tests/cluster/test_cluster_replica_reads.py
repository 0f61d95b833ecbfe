"""On a cluster whose appends wait for a replica, the gateways' streams read from the
replicas: a client never gets an event that only the master holds, which its
master's death would lose (docs/reliability.md, "Redis Cluster")."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from holdfast_shared.db.models import Task
from holdfast_shared.keys import Keys
from httpx_sse import aconnect_sse
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing.cluster import Node, RedisClusterServers
from tests.conftest import engine_env
from tests.processes import EngineProcesses, running_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

Sessions = async_sessionmaker[AsyncSession]
# Under the cluster's node timeout (1 s): the stopped replica is not failed over.
STOPPED_SECONDS = 0.8


@pytest.fixture(scope="module")
def waiting_engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}replicareads:",
        HOLDFAST_REDIS_WAIT_REPLICAS="1",
        HOLDFAST_REDIS_WAIT_TIMEOUT_MS="200",
    )
    with running_engine(
        env, workers=1, directory=tmp_path_factory.mktemp("cluster-replica-reads")
    ) as procs:
        yield procs


def _last_seq(node: Node, key: str) -> int:
    with node.client() as client:
        try:
            newest = client.xrevrange(key, count=1)
        except redis.ResponseError:  # MOVED: not this node's any more
            return 0
    # An entry's id is <seq>-0 (holdfast_shared.eventlog).
    return int(newest[0][0].split(b"-")[0]) if newest else 0


async def test_a_client_gets_only_what_a_replica_holds(
    waiting_engine: EngineProcesses,
    redis_cluster: RedisClusterServers,
    redis_prefix: str,
    api_keys: dict[str, str],
    sessions: Sessions,
) -> None:
    message = "/script " + json.dumps({"text": "w ", "deltas": 200, "delay_ms": 15})
    seqs: list[int] = []
    stopped_at: list[float] = []
    seen_while_stopped: list[int] = []
    master_while_stopped: list[int] = []

    async def stop_the_replica(task_name: str) -> None:
        async with sessions() as session:
            task_id = await session.scalar(select(Task.id).where(Task.name == task_name))
        assert task_id is not None
        key = Keys(f"{redis_prefix}replicareads:").events(task_id)
        master, replica = redis_cluster.serving(key)
        assert replica is not None and replica.process is not None
        replica.process.send_signal(signal.SIGSTOP)
        try:
            stopped_at.append(time.monotonic())
            # What the client has by now was sent before the stop.
            await asyncio.sleep(0.25)
            seen_while_stopped.append(seqs[-1])
            await asyncio.sleep(STOPPED_SECONDS - 0.25)
            seen_while_stopped.append(seqs[-1])
            master_while_stopped.append(await asyncio.to_thread(_last_seq, master, key))
        finally:
            replica.process.send_signal(signal.SIGCONT)

    stopper: asyncio.Task[None] | None = None
    async with (
        httpx.AsyncClient(timeout=60) as client,
        aconnect_sse(
            client,
            "POST",
            f"{waiting_engine.url}/execute",
            json={"message": message},
            headers={"X-Engine-Key": api_keys["main"]},
        ) as source,
    ):
        async for sse in source.aiter_sse():
            if sse.event == "heartbeat":
                continue
            event = json.loads(sse.data)
            seqs.append(event["seq"])
            if len(seqs) == 30 and stopper is None:
                stopper = asyncio.create_task(stop_the_replica(event["task_id"]))
            if event["type"] == "thread_lifecycle" and event.get("phase") == "completed":
                break
    assert stopper is not None
    await stopper
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "no gap, no repeat"
    # The master went on (each append gave up waiting for the replica after 200 ms),
    # and the client did not follow it while the replica could not.
    before, after = seen_while_stopped
    assert master_while_stopped[0] > after, (master_while_stopped, seen_while_stopped)
    assert after == before, f"events {before + 1}..{after} reached the client from the master"
