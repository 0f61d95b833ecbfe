"""Edit and retry fork the conversation (``branches.py``; ``POST /execute`` with
``edit_message_id`` / ``retry_message_id``): the model sees the new branch, the
old one stays readable, the log stays append-only, and a refusal writes nothing."""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import httpx
import pytest
from holdfast_loop_worker.context.compaction import Summaries
from holdfast_shared.branches import take_off_after
from holdfast_shared.conversation import load_history
from holdfast_shared.db.models import ContextSummary, ConversationFork, Message, Task, Turn
from holdfast_shared.ids import new_id, new_task_id
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.processes import EngineProcesses
from tests.sse_client import Received, execute
from tests.taskids import TENANTS, engine_task_id

pytestmark = pytest.mark.timeout(120)


def script(**kw: object) -> str:
    return "/script " + json.dumps(kw)


async def messages(
    client: httpx.AsyncClient, base: str, key: str, task: str, branch: str = "current"
) -> dict[str, Any]:
    response = await client.get(
        f"{base}/tasks/{task}/messages", params={"branch": branch}, headers={"X-Engine-Key": key}
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def texts(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (m["role"], "".join(b.get("text", "") for b in m["content"]["blocks"]))
        for m in body["messages"]
    ]


async def converse(
    client: httpx.AsyncClient, base: str, key: str, task: str, *words: str
) -> list[Received]:
    turns = []
    for word in words:
        got = await execute(client, base, key, {"message": word, "task_id": task})
        assert got.events[-1]["phase"] == "completed", got.events
        turns.append(got)
    return turns


async def test_edit_forks_and_the_model_sees_the_edited_history(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task = f"edit-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        turns = await converse(client, engine.url, key, task, "alpha", "beta", "gamma")
        before = await messages(client, engine.url, key, task)
        beta = before["messages"][2]
        assert beta["content"]["blocks"][0]["text"] == "beta"
        edited = await execute(
            client,
            engine.url,
            key,
            {"message": "delta", "task_id": task, "edit_message_id": beta["id"]},
        )
        # The scripted model echoes the latest user message and the one before it.
        assert edited.text == "You said: delta Earlier you said: alpha"
        started = edited.events[0]
        assert started["fork_reason"] == "edit"
        assert started["fork_from_turn_id"] == turns[1].events[0]["turn_id"]
        # The log goes on from where it was: nothing rewritten, nothing skipped.
        assert started["seq"] == turns[-1].events[-1]["seq"] + 1
        after = await converse(client, engine.url, key, task, "epsilon")
        assert after[0].text == "You said: epsilon Earlier you said: delta"
        current = await messages(client, engine.url, key, task)
        everything = await messages(client, engine.url, key, task, "all")
    assert texts(current) == [
        ("user", "alpha"),
        ("assistant", "You said: alpha"),
        ("user", "delta"),
        ("assistant", "You said: delta Earlier you said: alpha"),
        ("user", "epsilon"),
        ("assistant", "You said: epsilon Earlier you said: delta"),
    ]
    fork_id = started["fork_id"]
    off = [m for m in everything["messages"] if m["fork_id"] is not None]
    assert [m["id"] for m in off] == [m["id"] for m in before["messages"][2:]]
    assert {m["fork_id"] for m in off} == {fork_id}
    assert len(everything["messages"]) == len(before["messages"]) + 4
    assert everything["forks"] == [
        {
            "id": fork_id,
            "reason": "edit",
            "after_message_id": before["messages"][1]["id"],
            "created_at": everything["forks"][0]["created_at"],
        }
    ]


async def test_retry_answers_the_same_message_again(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task = f"retry-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        await converse(client, engine.url, key, task, "first", "second")
        before = await messages(client, engine.url, key, task)
        second = before["messages"][2]
        retried = await execute(
            client, engine.url, key, {"task_id": task, "retry_message_id": second["id"]}
        )
        current = await messages(client, engine.url, key, task)
        everything = await messages(client, engine.url, key, task, "all")
    assert retried.events[-1]["phase"] == "completed"
    assert retried.text == "You said: second Earlier you said: first"
    assert retried.events[0]["fork_reason"] == "retry"
    assert texts(current) == texts(before), "the same conversation, answered again"
    new_user = current["messages"][2]
    assert new_user["id"] > before["messages"][-1]["id"]
    assert new_user["turn_id"] == retried.events[0]["turn_id"]
    assert new_user["content"] == second["content"]
    old = [m["id"] for m in everything["messages"] if m["fork_id"] == retried.events[0]["fork_id"]]
    assert old == [second["id"], before["messages"][3]["id"]]


async def test_refusals_name_the_field_and_write_nothing(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: async_sessionmaker[AsyncSession]
) -> None:
    key = api_keys["main"]
    task = f"refuse-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        await converse(client, engine.url, key, task, "one", "two")
        listing = await messages(client, engine.url, key, task)
        first_user, first_answer, second_user = (m["id"] for m in listing["messages"][:3])
        # An edit takes "two" off the branch: it can no longer be edited or retried.
        await execute(
            client,
            engine.url,
            key,
            {"message": "deux", "task_id": task, "edit_message_id": second_user},
        )
        engine_id = await engine_task_id(sessions, task)
        counted = await _counts(sessions, engine_id)
        other_task = f"refuse-other-{secrets.token_hex(3)}"
        await converse(client, engine.url, key, other_task, "elsewhere")
        other_message = (await messages(client, engine.url, key, other_task))["messages"][0]["id"]

        cases: list[tuple[dict[str, Any], str]] = [
            ({"message": "x", "task_id": task, "edit_message_id": 10**15}, "edit_message_id"),
            ({"message": "x", "task_id": task, "edit_message_id": first_answer}, "edit_message_id"),
            ({"message": "x", "task_id": task, "edit_message_id": second_user}, "edit_message_id"),
            (
                {"message": "x", "task_id": task, "edit_message_id": other_message},
                "edit_message_id",
            ),
            ({"task_id": task, "retry_message_id": second_user}, "retry_message_id"),
            ({"task_id": task, "retry_message_id": 0}, "retry_message_id"),
            ({"message": "x", "task_id": task, "retry_message_id": first_user}, "message"),
            ({"message": "x", "edit_message_id": first_user}, "task_id"),
            ({"task_id": task}, "message"),
            (
                {
                    "message": "x",
                    "task_id": task,
                    "edit_message_id": first_user,
                    "retry_message_id": first_user,
                },
                "retry_message_id",
            ),
        ]
        for body, field in cases:
            refused = await client.post(
                f"{engine.url}/execute", json=body, headers={"X-Engine-Key": key}
            )
            assert refused.status_code == 422, (body, refused.text)
            error = refused.json()
            assert error["error"] == "INVALID_REQUEST"
            assert error["details"]["errors"][0]["loc"] == ["body", field], (body, error)

        # Another tenant's task, and a task that does not exist: 404, and no task is made.
        for tenant_key, name in (
            (api_keys["other"], task),
            (key, f"nothing-{secrets.token_hex(3)}"),
        ):
            refused = await client.post(
                f"{engine.url}/execute",
                json={"message": "x", "task_id": name, "edit_message_id": first_user},
                headers={"X-Engine-Key": tenant_key},
            )
            assert refused.status_code == 404 and refused.json()["error"] == "TASK_NOT_FOUND"
            gone = await client.get(
                f"{engine.url}/tasks/{name}", headers={"X-Engine-Key": tenant_key}
            )
            assert gone.status_code == 404

        # A busy task: 409 as for any message, and the fork is not made.
        slow = asyncio.create_task(
            execute(
                client,
                engine.url,
                key,
                {"message": script(text="z ", deltas=40, delay_ms=25), "task_id": task},
                limit=1,
            )
        )
        await slow
        busy = await client.post(
            f"{engine.url}/execute",
            json={"task_id": task, "retry_message_id": first_user},
            headers={"X-Engine-Key": key},
        )
        assert busy.status_code == 409 and busy.json()["error"] == "TURN_IN_PROGRESS"
        # The slow turn is the only thing written since.
        after = await _counts(sessions, engine_id)
        assert after == (counted[0] + 2, counted[1])
        # A forked task deletes like any other once idle.
        for _ in range(200):
            deleted = await client.delete(
                f"{engine.url}/tasks/{task}", headers={"X-Engine-Key": key}
            )
            if deleted.status_code != 409:
                break
            await asyncio.sleep(0.05)
        assert deleted.status_code == 200, deleted.text


async def _counts(sessions: async_sessionmaker[AsyncSession], task_id: str) -> tuple[int, int]:
    """How many messages (wait for the slow turn's answer) and forks the task has."""
    for _ in range(200):
        async with sessions() as session:
            found = await session.scalar(
                select(func.count()).select_from(Message).where(Message.task_id == task_id)
            )
            forks = await session.scalar(
                select(func.count())
                .select_from(ConversationFork)
                .where(ConversationFork.task_id == task_id)
            )
            running = await session.scalar(
                select(func.count())
                .select_from(Turn)
                .where(Turn.task_id == task_id, Turn.status.in_(("queued", "running")))
            )
        if not running:
            return int(found or 0), int(forks or 0)
        await asyncio.sleep(0.05)
    raise AssertionError("the task's turn did not end")


async def test_take_off_after_hides_messages_and_the_summaries_that_cover_them(
    sessions: async_sessionmaker[AsyncSession], api_keys: dict[str, str]
) -> None:
    task_id = new_task_id()
    async with sessions.begin() as session:
        session.add(Task(id=task_id, tenant_id=TENANTS["main"], name=f"fork-{task_id}"))
        await session.flush()
        ids = []
        for n in range(3):
            turn_id = new_id("turn")
            session.add(Turn(id=turn_id, task_id=task_id, status="completed"))
            await session.flush()
            for position, role in ((0, "user"), (1, "assistant")):
                message = Message(
                    task_id=task_id,
                    turn_id=turn_id,
                    position=position,
                    role=role,
                    content={"blocks": [{"type": "text", "text": f"{role} {n}"}]},
                )
                session.add(message)
                await session.flush()
                ids.append(message.id)
        for covered in (ids[1], ids[3]):
            session.add(
                ContextSummary(
                    task_id=task_id,
                    last_message_id=covered,
                    summary=f"through {covered}",
                    summarized_messages=2,
                    summary_tokens=5,
                    tokens_before=100,
                    tokens_after=50,
                    model="scripted",
                )
            )
    async with sessions() as session:
        latest = await Summaries.latest(session, task_id)
    assert latest is not None and latest.last_message_id == ids[3]

    async with sessions.begin() as session:
        fork_id = await take_off_after(session, task_id, ids[1], reason="rollback")
    async with sessions() as session:
        history = await load_history(session, task_id)
        latest = await Summaries.latest(session, task_id)
        fork = await session.get(ConversationFork, fork_id)
    assert [m.id for m in history] == ids[:2]
    # The summary through ids[3] covers messages now off the branch: not used.
    assert latest is not None and latest.last_message_id == ids[1]
    assert await Summaries(sessions).find(task_id, ids[3]) is None
    assert fork is not None and fork.reason == "rollback" and fork.after_message_id == ids[1]

    async with sessions.begin() as session:
        everything = await take_off_after(session, task_id, None, reason="edit")
    async with sessions() as session:
        assert await load_history(session, task_id) == []
        assert await Summaries.latest(session, task_id) is None
        taken = (
            await session.scalars(
                select(Message.taken_off_by).where(Message.task_id == task_id).order_by(Message.id)
            )
        ).all()
    assert taken == [everything] * 2 + [fork_id] * 4, "a message leaves the branch once"
    with pytest.raises(ValueError, match="reason"):
        async with sessions.begin() as session:
            await take_off_after(session, task_id, None, reason="undo")
    with pytest.raises(ValueError, match="no task"):
        async with sessions.begin() as session:
            await take_off_after(session, "tk_missing", None, reason="edit")
