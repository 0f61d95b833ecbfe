"""API key management: ``holdfast keys create / list / revoke``, last use, revocation.

The CLI runs as a real process against the suite's database; the gateway
under test is an extra one on the session's engine with a one-second auth
cache (``HOLDFAST_AUTH_CACHE_TTL_SECONDS=1``), so "a revoked key stops
working within the cache's TTL" is measured rather than waited out for the
default 30 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from holdfast_shared.apikeys import hash_key, identify_key, list_keys, revoke_key
from holdfast_shared.db.models import ApiKey
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing import add_api_key
from tests.processes import EngineProcesses
from tests.sse_client import execute

# Each CLI run starts Python afresh (a few seconds on a busy machine).
pytestmark = pytest.mark.timeout(180)

TTL = 1.0


@pytest.fixture(scope="module")
def gateway(engine: EngineProcesses) -> Iterator[str]:
    """The URL of a gateway of the session's engine that trusts a checked key for TTL s."""
    process = engine.start("gateway", env={"HOLDFAST_AUTH_CACHE_TTL_SECONDS": str(TTL)})
    assert process.url is not None
    yield process.url
    engine.kill(process, signal.SIGTERM)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as http:
        yield http


def keys_cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")}
    # Wide enough that the table is never cut.
    env.update(HOLDFAST_DATABASE_URL=database_url, COLUMNS="240")
    return subprocess.run(
        [sys.executable, "-m", "holdfast", "keys", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def cli(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(keys_cli, database_url, *args)


async def test_create_list_and_revoke_through_the_cli(
    gateway: str,
    database_url: str,
    client: httpx.AsyncClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    tenant = f"keys-{secrets.token_hex(3)}"
    label = f"laptop-{secrets.token_hex(3)}"
    created = await cli(database_url, "create", "--tenant", tenant, "--label", label)
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert key.startswith("hf_") and "\n" not in key
    headers = {"X-Engine-Key": key}

    # In use: a turn and a stream token for its task.
    task = f"k-{secrets.token_hex(3)}"
    message = "/script " + json.dumps({"text": "hello"})
    turn = await execute(client, gateway, key, {"message": message, "task_id": task})
    assert turn.events[-1]["phase"] == "completed"
    issued = await client.post(
        f"{gateway}/auth/stream-token", json={"task_id": task}, headers=headers
    )
    token = issued.json()["token"]

    async with sessions() as session:
        (info,) = await list_keys(session, tenant=tenant)
    assert (info.tenant, info.label, info.revoked_at) == (tenant, label, None)
    assert info.last_used_at is not None  # recorded by the gateway's look-up

    listed = await cli(database_url, "list", "--tenant", tenant)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if label in line)
    assert str(info.id) in row and tenant in row
    for secret in (key, hash_key(key), key[3:13]):
        assert secret not in listed.stdout + listed.stderr

    revoked = await cli(database_url, "revoke", str(info.id))
    assert revoked.returncode == 0, revoked.stderr
    start = time.monotonic()
    while (await client.get(f"{gateway}/agents", headers=headers)).status_code == 200:
        assert time.monotonic() - start < TTL + 2, "the revoked key still works past the TTL"
        await asyncio.sleep(0.1)
    refused = await client.get(f"{gateway}/agents", headers=headers)
    assert refused.status_code == 401 and refused.json()["error"] == "INVALID_KEY"
    # Its stream token went with it.
    replay = await client.get(f"{gateway}/execute/replay", params={"task_id": task, "token": token})
    assert replay.status_code == 401 and replay.json()["error"] == "INVALID_KEY"
    assert "revoked" in replay.json()["message"]

    async with sessions.begin() as session:
        (info,) = await list_keys(session, tenant=tenant)
        assert info.revoked_at is not None
        # Revoking twice is no error: it stays revoked, since the first time.
        assert await revoke_key(session, info.id) == info.revoked_at


async def test_revoking_an_unknown_key_fails_with_a_message(database_url: str) -> None:
    result = await cli(database_url, "revoke", "987654321")
    assert result.returncode == 1
    assert "no API key has id 987654321" in result.stderr
    bad = await cli(database_url, "revoke", "not-a-number")
    assert bad.returncode == 2 and "ID" in bad.stderr


async def test_last_use_is_written_at_most_once_a_minute(
    database_url: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    tenant = f"lu-{secrets.token_hex(3)}"
    key = await asyncio.to_thread(add_api_key, database_url, tenant)

    async def use() -> datetime | None:
        async with sessions.begin() as session:
            assert await identify_key(session, key) is not None
        async with sessions() as session:
            (info,) = await list_keys(session, tenant=tenant)
        return info.last_used_at

    first = await use()
    assert first is not None
    assert await use() == first  # a second use within the minute writes nothing
    async with sessions.begin() as session:
        await session.execute(
            update(ApiKey)
            .where(ApiKey.key_hash == hash_key(key))
            .values(last_used_at=datetime.now(UTC) - timedelta(minutes=2))
        )
    later = await use()
    assert later is not None and later >= first
