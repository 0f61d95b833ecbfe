"""Bad input gets a clear 4xx JSON error and writes nothing."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Message, Task
from holdfast_shared.keys import Keys
from sqlalchemy import func, select

from tests.processes import EngineProcesses
from tests.sse_client import execute, replay
from tests.taskids import engine_task_id

pytestmark = pytest.mark.timeout(60)


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["error"] == code
    assert isinstance(body["message"], str) and body["message"]
    return body


async def test_missing_and_wrong_key_are_401(engine: EngineProcesses) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as client:
        missing = await client.post("/execute", json={"message": "hi"})
        wrong = await client.post(
            "/execute", json={"message": "hi"}, headers={"X-Engine-Key": "hf_nope"}
        )
        bad_body_no_key = await client.post("/execute", json={})
        replay_no_key = await client.get("/execute/replay", params={"task_id": "x"})
    assert_error(missing, 401, "INVALID_KEY")
    assert_error(wrong, 401, "INVALID_KEY")
    assert_error(bad_body_no_key, 401, "INVALID_KEY")
    assert_error(replay_no_key, 401, "INVALID_KEY")


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({}, "message"),
        ({"message": ""}, "message"),
        ({"message": 5}, "message"),
        ({"message": "hi", "task_id": "has space"}, "task_id"),
        ({"message": "hi", "task_id": "a" * 200}, "task_id"),
        ({"message": "hi", "model": "nonsense:model"}, "model"),
        ({"message": "hi", "surprise": True}, "surprise"),
        ({"message": "hi", "media": "not-a-list"}, "media"),
        ({"message": "hi", "direct": "maybe"}, "direct"),
    ],
)
async def test_invalid_body_is_422(
    engine: EngineProcesses, api_keys: dict[str, str], body: dict[str, object], where: str
) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as client:
        response = await client.post(
            "/execute", json=body, headers={"X-Engine-Key": api_keys["main"]}
        )
    error = assert_error(response, 422, "INVALID_REQUEST")
    assert where in json.dumps(error["details"])


async def test_malformed_json_is_422(engine: EngineProcesses, api_keys: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as client:
        response = await client.post(
            "/execute",
            content=b'{"message": ',
            headers={"X-Engine-Key": api_keys["main"], "content-type": "application/json"},
        )
        bad_cursor = await client.get(
            "/execute/replay",
            params={"task_id": "x", "after_seq": "-3"},
            headers={"X-Engine-Key": api_keys["main"]},
        )
    assert_error(response, 422, "INVALID_REQUEST")
    assert_error(bad_cursor, 422, "INVALID_REQUEST")


async def test_task_names_are_per_tenant(
    engine: EngineProcesses, api_keys: dict[str, str], sessions
) -> None:
    # Another tenant using the same name gets a task of its own: it neither
    # sees this one nor learns that it exists (no 404 to probe names with).
    async with httpx.AsyncClient(timeout=30) as client:
        mine = await execute(client, engine.url, api_keys["main"], {"message": "private"})
        task_id = mine.headers["x-task-id"]
        theirs = await execute(
            client, engine.url, api_keys["other"], {"message": "peek", "task_id": task_id}
        )
        their_replay = await replay(
            client, engine.url, api_keys["other"], {"task_id": task_id, "after": 0}
        )
        my_replay = await replay(
            client, engine.url, api_keys["main"], {"task_id": task_id, "after": 0}
        )
        unknown = await replay(client, engine.url, api_keys["main"], {"task_id": "no-such-task"})
    assert theirs.status == 200 and theirs.headers["x-task-id"] == task_id
    assert theirs.events[0]["seq"] == 1, "a new task of its own"
    assert their_replay.events == theirs.events
    assert my_replay.events == mine.events
    assert all(e["task_id"] == task_id for e in my_replay.events + their_replay.events)
    assert unknown.status == 404 and unknown.body["error"] == "TASK_NOT_FOUND"
    async with sessions() as session:
        rows = (
            await session.execute(select(Task.tenant_id, Task.id).where(Task.name == task_id))
        ).all()
        assert sorted(tenant for tenant, _ in rows) == ["tenant-main", "tenant-other"]
        for _, engine_id in rows:
            count = await session.scalar(
                select(func.count()).select_from(Message).where(Message.task_id == engine_id)
            )
            assert count == 2  # each task has only its own user message and reply


async def test_second_execute_while_running_is_409(
    engine: EngineProcesses, api_keys: dict[str, str], sessions
) -> None:
    key = api_keys["main"]
    slow = "/script " + json.dumps({"text": "z ", "deltas": 20, "delay_ms": 50})
    async with httpx.AsyncClient(timeout=30) as client:
        # Read the first events and hang up: the turn goes on without us.
        first = await execute(client, engine.url, key, {"message": slow}, limit=2)
        task_id = [first.headers["x-task-id"]]
        conflict = await client.post(
            f"{engine.url}/execute",
            json={"message": "again", "task_id": task_id[0]},
            headers={"X-Engine-Key": key},
        )
        body = assert_error(conflict, 409, "TURN_IN_PROGRESS")
        assert body["details"]["task_id"] == task_id[0]
        # The running turn is unaffected and finishes.
        rest = await replay(client, engine.url, key, {"task_id": task_id[0]})
    assert rest.events[-1]["phase"] == "completed"
    engine_id = await engine_task_id(sessions, task_id[0])
    async with sessions() as session:
        users = await session.scalar(
            select(func.count())
            .select_from(Message)
            .where(Message.task_id == engine_id, Message.role == "user")
        )
    assert users == 1, "the refused message was not stored"


async def test_health_needs_no_key_and_tells_details_only_with_one(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as client:
        bare = await client.get("/health")
        keyed = await client.get("/health", headers={"X-Engine-Key": api_keys["main"]})
        bad = await client.get("/health", headers={"X-Engine-Key": "hf_not-a-key"})
    # A probe without a key learns the status and nothing about the deployment.
    assert bare.status_code == 200
    assert bare.json() == {"status": "ok"}
    body = keyed.json()
    assert keyed.status_code == 200
    assert body["status"] == "ok"
    assert body["uptime_seconds"] > 0
    assert body["subsystems"]["redis"]["status"] == "ok"
    assert body["subsystems"]["postgres"]["status"] == "ok"
    assert "memory" in body["subsystems"] and "fanout" in body["subsystems"]
    assert bad.status_code == 401 and bad.json()["error"] == "INVALID_KEY"


async def test_a_lock_left_by_a_dead_gateway_does_not_block_the_task(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    redis: Any,
    redis_prefix: str,
    sessions: Any,
) -> None:
    # A gateway killed between taking the turn lock and committing the turn
    # leaves a lock whose turn never existed.
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        first = await execute(client, engine.url, key, {"message": "before"})
        task_id = first.headers["x-task-id"]
        lock = Keys(redis_prefix).running_turn(await engine_task_id(sessions, task_id))
        ghost = f"turn_{int((time.time() - 60) * 1000):012x}{'0' * 16}"
        await redis.set(lock, ghost, ex=3600)
        after = await execute(client, engine.url, key, {"message": "after", "task_id": task_id})
        fresh = f"turn_{int(time.time() * 1000):012x}{'0' * 16}"
        await redis.set(lock, fresh, ex=3600)
        young = await client.post(
            f"{engine.url}/execute",
            json={"message": "too soon", "task_id": task_id},
            headers={"X-Engine-Key": key},
        )
        await redis.delete(lock)
    assert after.status == 200 and after.events[-1]["phase"] == "completed"
    # A young lock may belong to a request still committing: it is respected.
    assert young.status_code == 409
