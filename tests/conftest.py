"""Fixtures: real Redis and PostgreSQL, isolated per run, and real engine processes."""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from holdfast_shared.db import create_engine, session_factory, upgrade_head
from holdfast_shared.eventlog import EventLog
from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import connect
from holdfast_shared.tenancy import add_key
from redis.asyncio import Redis
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.processes import EngineProcesses, unmount_workspaces
from tests.servers import postgres_server, redis_server

RUN_ID = secrets.token_hex(4)


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

    async def cleanup() -> None:
        client = connect(redis_url)
        async for key in client.scan_iter(match=f"{prefix}*", count=1000):
            await client.delete(key)
        await client.aclose()

    asyncio.run(cleanup())


def _database(admin_url: str, name: str) -> str:
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def _psycopg_url(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def database_url(server_dir: Path) -> Iterator[str]:
    """A fresh, migrated database of this run, dropped at the end."""
    with postgres_server(server_dir) as admin_url:
        name = f"hftest_{RUN_ID}"
        with psycopg.connect(_psycopg_url(admin_url), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = _database(admin_url, name)
        upgrade_head(url)
        try:
            yield url
        finally:
            with psycopg.connect(_psycopg_url(admin_url), autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


API_KEY = f"hf_test_{secrets.token_hex(16)}"
OTHER_KEY = f"hf_other_{secrets.token_hex(16)}"


@pytest.fixture(scope="session")
def api_keys(database_url: str) -> dict[str, str]:
    """Keys of two tenants: ``main`` and ``other``."""

    async def create() -> None:
        engine = create_engine(database_url)
        sessions = session_factory(engine)
        async with sessions.begin() as session:
            await add_key(session, "tenant-main", API_KEY)
            await add_key(session, "tenant-other", OTHER_KEY)
        await engine.dispose()

    asyncio.run(create())
    return {"main": API_KEY, "other": OTHER_KEY}


def engine_env(redis_url: str, database_url: str, prefix: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")}
    env.update(
        HOLDFAST_REDIS_URL=redis_url,
        HOLDFAST_DATABASE_URL=database_url,
        HOLDFAST_REDIS_PREFIX=prefix,
        HOLDFAST_HEARTBEAT_SECONDS="1",
        HOLDFAST_ARCHIVE_INTERVAL_SECONDS="0.1",
        HOLDFAST_MODEL="scripted",
        HOLDFAST_LOG_LEVEL="WARNING",
    )
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def workspace_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("workspaces")
    yield root
    unmount_workspaces(root)


@pytest.fixture(scope="session")
def engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    workspace_root: Path,
) -> Iterator[EngineProcesses]:
    """A gateway, a loop-worker and a tool-runner as real processes, shared by the session."""
    procs = EngineProcesses(
        engine_env(
            redis_url, database_url, redis_prefix, HOLDFAST_WORKSPACE_ROOT=str(workspace_root)
        )
    )
    procs.start_tool_runner()
    procs.start_worker()
    procs.start_gateway()
    try:
        yield procs
    finally:
        procs.stop()


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
    return EventLog(redis, sessions, Keys(redis_prefix), hot_ttl_seconds=10800)
