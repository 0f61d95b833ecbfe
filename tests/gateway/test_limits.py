"""Per-tenant limits: requests per minute, running turns and waiting turns. Over one the
gateway answers 429 RATE_LIMITED with Retry-After and the limit's name, and writes
nothing; a slot comes back when a turn ends, whichever way it ends; other tenants
never notice (real gateway and worker processes)."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Task, Turn
from holdfast_shared.turnqueue import PENDING
from sqlalchemy import select

from holdfast.testing.database import add_api_key
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import Received, execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

RATE = 12
SLOW = "/script " + json.dumps({"text": "x", "deltas": 400, "delay_ms": 50})


@pytest.fixture(scope="module")
def limited(
    redis_url: str, database_url: str, redis_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcesses]:
    prefix = f"{redis_prefix}limits-{secrets.token_hex(3)}:"
    env = engine_env(
        redis_url,
        database_url,
        prefix,
        HOLDFAST_TENANT_RATE_PER_MINUTE=str(RATE),
        HOLDFAST_TENANT_MAX_RUNNING_TURNS="2",
        HOLDFAST_TENANT_MAX_QUEUED_TURNS="1",
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("limits")) as procs:
        yield procs


def new_tenant(database_url: str) -> str:
    """A tenant of its own: the turn counts are the tenant's across the whole database."""
    return add_api_key(database_url, f"tenant-limits-{secrets.token_hex(4)}")


def assert_limited(response: httpx.Response | Received, limit: str) -> dict[str, Any]:
    status = response.status_code if isinstance(response, httpx.Response) else response.status
    body = response.json() if isinstance(response, httpx.Response) else response.body
    assert status == 429, body
    assert body["error"] == "RATE_LIMITED"
    assert body["details"]["limit"] == limit
    assert limit in body["message"]
    retry_after = int(response.headers["Retry-After"])
    assert 1 <= retry_after <= 60
    return dict(body)


async def task_exists(sessions: Any, name: str) -> bool:
    async with sessions() as session:
        return await session.scalar(select(Task.id).where(Task.name == name)) is not None


async def until_turn_in(sessions: Any, name: str, statuses: tuple[str, ...]) -> None:
    """Wait until a turn of the task ``name`` is in one of ``statuses`` (read from the
    database: the API's reads would count against the tenant's rate)."""
    for _ in range(400):
        async with sessions() as session:
            found = await session.scalar(
                select(Turn.id)
                .join(Task, Task.id == Turn.task_id)
                .where(Task.name == name, Turn.status.in_(statuses))
                .limit(1)
            )
        if found is not None:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no turn of {name} became {statuses}")


async def test_requests_per_minute(
    limited: EngineProcesses, database_url: str, api_keys: dict[str, str], sessions: Any
) -> None:
    key = new_tenant(database_url)
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(RATE):
            assert (await client.get(f"{limited.url}/tasks", headers=headers)).status_code == 200
        assert_limited(
            await client.get(f"{limited.url}/tasks", headers=headers),
            "HOLDFAST_TENANT_RATE_PER_MINUTE",
        )
        # A refused POST writes nothing: not even the task it names.
        name = f"rate-{secrets.token_hex(4)}"
        refused = await execute(client, limited.url, key, {"message": "hi", "task_id": name})
        assert_limited(refused, "HOLDFAST_TENANT_RATE_PER_MINUTE")
        # Another tenant is not affected.
        other = await client.get(
            f"{limited.url}/tasks", headers={"X-Engine-Key": api_keys["other"]}
        )
        assert other.status_code == 200
    assert not await task_exists(sessions, name)


async def test_running_and_waiting_turns(
    limited: EngineProcesses, database_url: str, sessions: Any
) -> None:
    key = new_tenant(database_url)
    base = limited.url
    names = [f"busy-{i}-{secrets.token_hex(3)}" for i in range(3)]
    async with httpx.AsyncClient(timeout=60) as client:
        turns = [
            asyncio.create_task(execute(client, base, key, {"message": SLOW, "task_id": n}))
            for n in names[:2]
        ]
        for name in names[:2]:
            await until_turn_in(sessions, name, ("running",))
        # A third turn would be the tenant's third running one.
        third = await execute(client, base, key, {"message": "hi", "task_id": names[2]})
        assert_limited(third, "HOLDFAST_TENANT_MAX_RUNNING_TURNS")
        assert not await task_exists(sessions, names[2])

        # One message may wait behind a running turn; the next is the tenant's second.
        waiting = asyncio.create_task(
            execute(
                client, base, key, {"message": "later", "task_id": names[0], "on_busy": "enqueue"}
            )
        )
        await until_turn_in(sessions, names[0], PENDING)
        second = await execute(
            client, base, key, {"message": "later too", "task_id": names[1], "on_busy": "enqueue"}
        )
        assert_limited(second, "HOLDFAST_TENANT_MAX_QUEUED_TURNS")

        # Cancelling ends the first turn; its queued message runs as the next turn, and
        # the second task's turn is cancelled too: the count follows the turns' status.
        for name in names[:2]:
            cancel = await client.post(
                f"{base}/execute/cancel", json={"task_id": name}, headers={"X-Engine-Key": key}
            )
            assert cancel.status_code == 200, cancel.text
        ended = await asyncio.gather(*turns)
        assert all(t.events[-1]["stop_reason"] == "cancelled" for t in ended)
        ran = await asyncio.wait_for(waiting, 60)
        assert ran.events[-1]["phase"] == "completed"
        # Every turn of the tenant ended: a new one is accepted.
        again = await execute(client, base, key, {"message": "hi", "task_id": names[2]})
    assert again.status == 200
    assert again.events[-1]["phase"] == "completed"


async def test_a_subagents_turn_counts_as_a_running_turn(
    limited: EngineProcesses, database_url: str, sessions: Any
) -> None:
    """A ``delegate`` call writes a turn: at the tenant's running turns limit it
    starts no child, and its result says why."""
    key = new_tenant(database_url)
    base = limited.url
    busy, parent = (f"{n}-{secrets.token_hex(3)}" for n in ("busy", "delegating"))
    brief = "/script " + json.dumps({"text": "found it"})
    delegate = {"name": "delegate", "input": {"agent": "researcher", "brief": brief}}
    message = "/script " + json.dumps({"tool_calls": [delegate]})
    async with httpx.AsyncClient(timeout=60) as client:
        slow = asyncio.create_task(execute(client, base, key, {"message": SLOW, "task_id": busy}))
        await until_turn_in(sessions, busy, ("running",))
        # The parent is the tenant's second running turn; its child would be the third.
        refused = await execute(client, base, key, {"message": message, "task_id": parent})
        cancel = await client.post(
            f"{base}/execute/cancel", json={"task_id": busy}, headers={"X-Engine-Key": key}
        )
        assert cancel.status_code == 200, cancel.text
        await slow
        # With the slot free, the same call starts its child.
        allowed = await execute(client, base, key, {"message": message, "task_id": parent})
    assert refused.events[-1]["phase"] == "completed", refused.events[-3:]
    result = next(e for e in refused.events if e["type"] == "tool_result")
    assert "HOLDFAST_TENANT_MAX_RUNNING_TURNS" in (result.get("error") or ""), result
    assert not [e for e in refused.events if e["type"] == "subagent_started"]
    assert allowed.events[-1]["phase"] == "completed", allowed.events[-3:]
    result = next(e for e in allowed.events if e["type"] == "tool_result" and not e.get("subagent"))
    assert result.get("output") == "found it", result
