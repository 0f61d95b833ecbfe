"""Fixtures of the Redis Cluster tests: the suite's own fixtures, on a real local cluster.

Overriding ``redis_url`` (and the client built from it) here points every engine
these tests start at a cluster of three masters and three replicas: the harness
(``holdfast.testing.environment``) sees a cluster node and runs the engine with
``HOLDFAST_REDIS_CLUSTER=true``. Tests of the other modules are reused by importing
them (and their module fixtures) into this directory's modules. Each module has a
database of its own (tests/isolation.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from holdfast_shared.redisconn import connect
from redis.asyncio import Redis

from holdfast.testing.cluster import RedisClusterServers
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url
from tests.processes import EngineProcesses, running_engine

__all__ = ["own_api_keys", "own_database_url"]


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    with RedisClusterServers() as servers:
        yield servers


@pytest.fixture(scope="session")
def redis_url(redis_cluster: RedisClusterServers) -> str:
    # The seed node only: the clients learn the rest of the cluster from it.
    return redis_cluster.url


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url, cluster=True)
    yield client
    await client.aclose()


@pytest.fixture(scope="module")
def engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    workspace_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """The suite's engine on the cluster, one per module on the module's own database
    (tests/isolation.py); the learning service has a test of its own
    (test_cluster_learning.py)."""
    env = engine_env(
        redis_url, database_url, f"{redis_prefix}cl:", HOLDFAST_WORKSPACE_ROOT=str(workspace_root)
    )
    with running_engine(
        env, runners=1, directory=tmp_path_factory.mktemp("cluster-engine")
    ) as procs:
        yield procs
