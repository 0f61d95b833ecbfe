"""Fixtures: real Redis and PostgreSQL, isolated per run, and real engine processes."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from holdfast_shared.assets import Vault
from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.eventlog import EventLog
from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import connect
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing import create_database, delete_keys, drop_database, time_scale
from tests.isolation import RUN_ID, session_keys
from tests.processes import EngineProcesses, engine_from_env
from tests.servers import postgres_server, redis_server


@pytest.fixture(scope="session")
def server_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("servers")


@pytest.fixture(scope="session")
def redis_url(server_dir: Path) -> Iterator[str]:
    with redis_server(server_dir) as url:
        yield url


@pytest.fixture(scope="session")
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this run; every key under it is deleted at the end."""
    prefix = f"hftest:{RUN_ID}:"
    yield prefix
    delete_keys(redis_url, prefix)


@pytest.fixture(scope="session")
def postgres_url(server_dir: Path) -> Iterator[str]:
    """A URL of the PostgreSQL server: of a database to create others from."""
    with postgres_server(server_dir) as admin_url:
        yield admin_url


@pytest.fixture(scope="session")
def database_url(postgres_url: str) -> Iterator[str]:
    """A fresh, migrated database of this run, dropped at the end."""
    name = f"hftest_{RUN_ID}"
    url = create_database(postgres_url, name)
    try:
        yield url
    finally:
        drop_database(postgres_url, name)


@pytest.fixture(scope="session")
def api_keys(database_url: str) -> dict[str, str]:
    """Keys of two tenants: ``main`` and ``other``."""
    return session_keys(database_url)


# One Asset Directory key for every engine of the session: engines on the same
# database open each other's stored credentials.
ASSET_KEY = Vault.generate_key()


def engine_env(redis_url: str, database_url: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")}
    env.update(
        HOLDFAST_ASSET_ENCRYPTION_KEY=ASSET_KEY,
        HOLDFAST_REDIS_URL=redis_url,
        HOLDFAST_DATABASE_URL=database_url,
        HOLDFAST_REDIS_PREFIX=prefix,
        HOLDFAST_HEARTBEAT_SECONDS="1",
        HOLDFAST_ARCHIVE_INTERVAL_SECONDS="0.1",
        HOLDFAST_MODEL="scripted",
        # Two pytest-xdist workers run many engines on one PostgreSQL (max_connections
        # is often 100): each process keeps 2 connections open, bursts open more.
        HOLDFAST_DATABASE_POOL_SIZE="2",
        HOLDFAST_LOG_LEVEL=os.environ.get("HOLDFAST_TEST_ENGINE_LOG_LEVEL", "WARNING"),
        # The tests' MCP servers and OAuth stand-ins listen on loopback, which the
        # outbound policy refuses by default (tests/shared/test_outbound.py runs without it).
        HOLDFAST_OUTBOUND_ALLOW="127.0.0.1/32,::1/128,localhost",
    )
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def workspace_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session engine's workspaces (it unmounts them when it stops)."""
    return tmp_path_factory.mktemp("workspaces")


@pytest.fixture(scope="session")
def engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    workspace_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """A gateway, a loop-worker, a tool-runner and the learning centre as real
    processes, shared by the session."""
    env = engine_env(
        redis_url, database_url, redis_prefix, HOLDFAST_WORKSPACE_ROOT=str(workspace_root)
    )
    with engine_from_env(env, tmp_path_factory.mktemp("engine")) as procs:
        procs.start_tool_runner()
        procs.start_worker()
        procs.start_gateway()
        procs.start_learning()
        yield procs


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def sessions(database_url: str) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(database_url, pool_size=2)
    yield session_factory(engine)
    await engine.dispose()


@pytest.fixture
async def eventlog(
    redis: Redis, sessions: async_sessionmaker[AsyncSession], redis_prefix: str
) -> EventLog:
    # A prefix no engine process of the session uses: their archivers would
    # otherwise archive these tests' logs between the steps the tests control.
    return EventLog(redis, sessions, Keys(f"{redis_prefix}eventlog:"), hot_ttl_seconds=10800)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test's timeout is a liveness bound too: scaled to the machine like the harness's
    (``HOLDFAST_TEST_TIME_SCALE``, else the load per CPU; holdfast.testing.timescale)."""
    scale = time_scale()
    if scale == 1.0:
        return
    default = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    for item in items:
        marker = item.get_closest_marker("timeout")
        given = marker.kwargs.get("timeout", *marker.args[:1]) if marker else default
        if given:
            item.add_marker(pytest.mark.timeout(float(given) * scale), append=False)
