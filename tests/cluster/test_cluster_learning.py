"""The learning centre on a Redis Cluster: trajectories are learned, arq's cron jobs
run in their one slot, and both go on after the master of that slot is killed."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from holdfast_shared.db.models import TrajectoryRecord
from holdfast_shared.keys import Keys, arq_slot_tag
from holdfast_shared.redisconn import ClusterClient
from redis.asyncio import Redis
from redis.crc import key_slot
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing.cluster import Node, RedisClusterServers
from holdfast.testing.timescale import scaled
from tests.conftest import engine_env
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute

# Each phase below has a bound of its own, well inside this one, so a stuck phase
# fails with the engine's logs and the test's own clean-up still runs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

Sessions = async_sessionmaker[AsyncSession]


@pytest.fixture(scope="module")
def learning_engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(redis_url, database_url, f"{redis_prefix}learncl:")
    with running_engine(
        env, workers=1, learners=1, directory=tmp_path_factory.mktemp("cluster-learning")
    ) as procs:
        yield procs


@pytest.fixture(autouse=True)
def whole_cluster(redis_cluster: RedisClusterServers) -> Iterator[None]:
    """Every node back up after each test, even one that failed before its own
    restart: the next test (and module) starts on the whole cluster."""
    yield
    redis_cluster.heal()


async def _learned(
    engine: EngineProcesses, key: str, sessions: Sessions, within: float = 45
) -> None:
    """A turn whose trajectory the learning centre then takes in."""
    async with httpx.AsyncClient(timeout=60) as client:
        try:
            async with asyncio.timeout(scaled(60)):
                got = await execute(
                    client,
                    engine.url,
                    key,
                    {
                        "message": "My parcel went to depot 7.",
                        "user_id": f"u-{secrets.token_hex(4)}",
                    },
                )
        except TimeoutError:
            pytest.fail(f"the turn did not end:\n{engine.log_tail(*engine.processes, lines=40)}")
    turn_id = str(got.events[0]["turn_id"])
    deadline = time.monotonic() + within
    while True:
        async with sessions() as session:
            status = await session.scalar(
                select(TrajectoryRecord.status).where(TrajectoryRecord.id == turn_id)
            )
        if status == "done":
            return
        assert time.monotonic() < deadline, f"trajectory {turn_id} still {status!r}"
        await asyncio.sleep(0.2)


async def _cron_runs(redis: Redis, prefix: str) -> list[int]:
    """When arq started the learning sweep's runs of the last minute (ms): arq keeps
    each run's in-progress key that long, in the queue's slot."""
    pattern = f"arq:in-progress:{{{arq_slot_tag(prefix)}}}learning-sweep:*"
    found = await redis.keys(pattern, target_nodes=ClusterClient.PRIMARIES)
    return sorted(int(key.rsplit(":", 1)[1]) for key in found)


def _kill_synced_master(servers: RedisClusterServers, key: str) -> Node:
    # A node restarted by the previous test may still be syncing.
    servers.wait_in_sync(key)
    return servers.kill_master(key)


async def test_learning_on_a_cluster_goes_on_after_its_arq_master_dies(
    learning_engine: EngineProcesses,
    redis_cluster: RedisClusterServers,
    redis: Redis,
    redis_prefix: str,
    api_keys: dict[str, str],
    sessions: Sessions,
) -> None:
    prefix = f"{redis_prefix}learncl:"
    await _learned(learning_engine, api_keys["main"], sessions)
    deadline = time.monotonic() + 30
    while not await _cron_runs(redis, prefix):
        assert time.monotonic() < deadline, "arq never ran the learning sweep"
        await asyncio.sleep(0.2)

    killed_at = time.time() * 1000
    queue = Keys(prefix).learning_queue(cluster=True)
    dead = await asyncio.to_thread(_kill_synced_master, redis_cluster, queue)
    try:
        await asyncio.to_thread(redis_cluster.wait_failover, dead)
        # The sweep runs every 10 s: one started on the new master.
        deadline = time.monotonic() + 40
        while not [ms for ms in await _cron_runs(redis, prefix) if ms > killed_at]:
            assert time.monotonic() < deadline, "arq did not run again after the failover"
            await asyncio.sleep(0.5)
        await _learned(learning_engine, api_keys["main"], sessions)
        (learner,) = learning_engine.of("learning")
        assert learner.alive
    finally:
        await asyncio.to_thread(redis_cluster.restart, dead)


def test_every_key_arq_makes_for_the_learning_service_is_in_one_slot() -> None:
    keys = Keys("some:prefix:")
    queue = keys.learning_queue(cluster=True)
    job = keys.learning_job("learning-sweep", cluster=True)
    made = [
        queue,
        f"{queue}:health-check",
        "arq:abort",
        *(f"arq:{kind}:{job}:1764150000000" for kind in ("job", "in-progress", "result", "retry")),
    ]
    assert len({key_slot(key.encode()) for key in made}) == 1, made
    # On one Redis server: the names as before.
    assert keys.learning_queue() == "some:prefix:learning"
    assert keys.learning_job("retention") == "some:prefix:retention"


async def test_a_learner_stopped_while_its_arq_master_is_gone_exits_cleanly(
    learning_engine: EngineProcesses, redis_cluster: RedisClusterServers, redis_prefix: str
) -> None:
    """Between two of arq's workers (its master dead, the next one not built yet)
    SIGTERM is the learning service's own: it stops, it does not wait for the
    failover and go on."""
    (learner,) = learning_engine.of("learning")
    queue = Keys(f"{redis_prefix}learncl:").learning_queue(cluster=True)
    dead = await asyncio.to_thread(_kill_synced_master, redis_cluster, queue)
    try:
        deadline = time.monotonic() + 10
        while "arq lost its Redis master" not in learner.log.read_text():
            assert time.monotonic() < deadline, "arq did not notice its master's death"
            await asyncio.sleep(0.1)
        status = await asyncio.to_thread(learning_engine.kill, learner, signal.SIGTERM, grace=10)
        assert status == 0, learning_engine.log_tail(learner)
    finally:
        await asyncio.to_thread(redis_cluster.wait_failover, dead)
        await asyncio.to_thread(redis_cluster.restart, dead)
