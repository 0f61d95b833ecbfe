"""Task status through real processes: GET /tasks, /tasks/{task_id}, /tasks/{task_id}/messages,
and the ``active_seconds`` of ``usage`` events."""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Task, Turn
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing import add_api_key
from tests.processes import EngineProcesses
from tests.sse_client import Received, execute

pytestmark = pytest.mark.timeout(120)


def script(**kw: object) -> str:
    return "/script " + json.dumps(kw)


def by_type(got: Received, event_type: str) -> list[dict[str, Any]]:
    return [e for e in got.events if e["type"] == event_type]


@pytest.fixture(scope="module")
def fresh_key(database_url: str) -> str:
    """A tenant of this module's own, so its task list holds only these tests' tasks."""
    return add_api_key(database_url, f"tenant-tasks-{secrets.token_hex(3)}")


@pytest.fixture(scope="module")
def list_key(database_url: str) -> str:
    """Another tenant of its own, for the list's exact pages."""
    return add_api_key(database_url, f"tenant-list-{secrets.token_hex(3)}")


async def status_of(client: httpx.AsyncClient, base: str, key: str, task: str) -> dict[str, Any]:
    response = await client.get(f"{base}/tasks/{task}", headers={"X-Engine-Key": key})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def wait_for_status(
    client: httpx.AsyncClient, base: str, key: str, task: str, status: str
) -> dict[str, Any]:
    for _ in range(400):
        response = await client.get(f"{base}/tasks/{task}", headers={"X-Engine-Key": key})
        if response.status_code == 200 and response.json()["status"] == status:
            body: dict[str, Any] = response.json()
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"task {task} never became {status}: {response.text}")


async def test_status_running_then_idle_with_usage_and_last_event(
    engine: EngineProcesses, fresh_key: str
) -> None:
    key = fresh_key
    task = f"status-{secrets.token_hex(3)}"
    slow = script(text="tok ", deltas=30, delay_ms=30)
    async with httpx.AsyncClient(timeout=60) as client:
        turn = asyncio.create_task(
            execute(client, engine.url, key, {"message": slow, "task_id": task})
        )
        running = await wait_for_status(client, engine.url, key, task, "running")
        assert running["current_turn"]["status"] in ("queued", "running")
        listed = await client.get(
            f"{engine.url}/tasks", params={"status": "running"}, headers={"X-Engine-Key": key}
        )
        assert [t["task_id"] for t in listed.json()["tasks"]] == [task]
        got = await turn
        assert got.events[-1]["phase"] == "completed"
        state = await status_of(client, engine.url, key, task)
    assert state["status"] == "idle" and state["task_id"] == task
    assert state["turn_count"] == 1
    assert state["current_turn"]["turn_id"] == got.events[0]["turn_id"]
    assert state["current_turn"]["status"] == "completed"
    assert state["current_turn"]["stop_reason"] == "end_turn"
    assert state["pending_hitl"] is None
    usage = by_type(got, "usage")[-1]
    # ~30 deltas 30 ms apart: the turn was active for most of a second.
    assert usage["active_seconds"] > 0.5, usage
    totals = state["usage"]
    assert totals["output_tokens"] == usage["output_tokens"] > 0
    assert totals["input_tokens"] == usage["input_tokens"] > 0
    assert totals["active_seconds"] >= usage["active_seconds"]
    assert state["last_seq"] == got.events[-1]["seq"]
    assert state["last_event_at"] == got.events[-1]["timestamp"]


async def test_status_waiting_on_a_question(engine: EngineProcesses, fresh_key: str) -> None:
    key = fresh_key
    task = f"waiting-{secrets.token_hex(3)}"
    ask = script(text="", tool_calls=[{"name": "ask_user", "input": {"question": "Colour?"}}])
    async with httpx.AsyncClient(timeout=60) as client:
        turn = asyncio.create_task(
            execute(client, engine.url, key, {"message": ask, "task_id": task})
        )
        waiting = await wait_for_status(client, engine.url, key, task, "waiting")
        question = waiting["pending_hitl"]
        assert question["kind"] == "question" and question["question"] == "Colour?"
        assert waiting["current_turn"]["status"] == "parked"
        listed = await client.get(
            f"{engine.url}/tasks", params={"status": "waiting"}, headers={"X-Engine-Key": key}
        )
        assert task in [t["task_id"] for t in listed.json()["tasks"]]
        answered = await client.post(
            f"{engine.url}/hitl/respond",
            headers={"X-Engine-Key": key},
            json={"task_id": task, "request_id": question["request_id"], "answer": "teal"},
        )
        assert answered.status_code == 200, answered.text
        got = await turn
        assert got.events[-1]["phase"] == "completed"
        state = await status_of(client, engine.url, key, task)
    assert state["status"] == "idle" and state["pending_hitl"] is None
    # Two model calls, summed; the time parked is not active time.
    assert state["usage"]["output_tokens"] == by_type(got, "usage")[-1]["output_tokens"]
    assert state["usage"]["active_seconds"] > 0


async def recorded(sessions: async_sessionmaker[AsyncSession], name: str) -> None:
    """Wait until the task's turns have their ends on their rows: a turn's end
    counts as activity too, and lands on the row just after the stream ends."""
    for _ in range(200):
        async with sessions() as session:
            open_turns = await session.scalar(
                select(func.count())
                .select_from(Turn)
                .join(Task, Task.id == Turn.task_id)
                .where(Task.name == name, Turn.status.in_(("queued", "running")))
            )
        if not open_turns:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the turns of {name} did not end")


async def test_list_is_paginated_newest_activity_first_and_filtered(
    engine: EngineProcesses, list_key: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    key = list_key
    headers = {"X-Engine-Key": key}
    names = [f"page-{i}-{secrets.token_hex(2)}" for i in range(3)]
    async with httpx.AsyncClient(timeout=60) as client:
        for name in names:
            got = await execute(client, engine.url, key, {"message": "hi", "task_id": name})
            assert got.events[-1]["phase"] == "completed"
            await recorded(sessions, name)

        async def page(**params: Any) -> dict[str, Any]:
            response = await client.get(f"{engine.url}/tasks", params=params, headers=headers)
            assert response.status_code == 200, response.text
            body: dict[str, Any] = response.json()
            return body

        first = await page(limit=2)
        assert [t["task_id"] for t in first["tasks"]] == [names[2], names[1]]
        assert all(t["status"] == "idle" and t["turn_count"] == 1 for t in first["tasks"])
        second = await page(limit=2, cursor=first["next_cursor"])
        assert [t["task_id"] for t in second["tasks"]] == [names[0]]
        assert second["next_cursor"] is None
        # New activity moves a task to the front.
        await execute(client, engine.url, key, {"message": "again", "task_id": names[0]})
        await recorded(sessions, names[0])
        everything = await page()
        assert [t["task_id"] for t in everything["tasks"]] == [names[0], names[2], names[1]]
        assert everything["tasks"][0]["turn_count"] == 2
        assert len((await page(status="idle"))["tasks"]) == 3
        assert (await page(status="running"))["tasks"] == []
        assert (await page(status="paused"))["tasks"] == []
        for params, field in (
            ({"cursor": "not-a-cursor"}, "cursor"),
            ({"status": "sleeping"}, "status"),
            ({"limit": 0}, "limit"),
        ):
            refused = await client.get(f"{engine.url}/tasks", params=params, headers=headers)
            assert refused.status_code == 422, refused.text
            body = refused.json()
            assert body["error"] == "INVALID_REQUEST"
            assert body["details"]["errors"][0]["loc"] == ["query", field]


async def test_messages_in_order_and_other_tenants_task_is_not_found(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task = f"messages-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        first = await execute(client, engine.url, key, {"message": "one", "task_id": task})
        second = await execute(client, engine.url, key, {"message": "two", "task_id": task})
        response = await client.get(
            f"{engine.url}/tasks/{task}/messages", headers={"X-Engine-Key": key}
        )
        paged = await client.get(
            f"{engine.url}/tasks/{task}/messages",
            params={"limit": 3},
            headers={"X-Engine-Key": key},
        )
        rest = await client.get(
            f"{engine.url}/tasks/{task}/messages",
            params={"after": paged.json()["next_after"]},
            headers={"X-Engine-Key": key},
        )
        theirs = [
            await client.get(f"{engine.url}{path}", headers={"X-Engine-Key": api_keys["other"]})
            for path in (f"/tasks/{task}", f"/tasks/{task}/messages")
        ]
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["task_id"] == task and body["branch"] == "current" and body["forks"] == []
    messages = body["messages"]
    turn_ids = [first.events[0]["turn_id"], second.events[0]["turn_id"]]
    assert [(m["turn_id"], m["role"]) for m in messages] == [
        (turn_ids[0], "user"),
        (turn_ids[0], "assistant"),
        (turn_ids[1], "user"),
        (turn_ids[1], "assistant"),
    ]
    assert [m["id"] for m in messages] == sorted(m["id"] for m in messages)
    assert messages[0]["content"]["blocks"] == [{"type": "text", "text": "one"}]
    assert messages[3]["content"]["blocks"][0]["text"] == second.text
    assert all(m["created_at"] for m in messages)
    assert [m["id"] for m in paged.json()["messages"] + rest.json()["messages"]] == [
        m["id"] for m in messages
    ]
    assert rest.json()["next_after"] is None
    for refused in theirs:
        assert refused.status_code == 404 and refused.json()["error"] == "TASK_NOT_FOUND"
