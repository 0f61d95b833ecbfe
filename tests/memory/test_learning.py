"""The learning centre end to end: turns → trajectories → memory → the next task's context.

The engine is the session's (gateway, loop-worker, tool-runner, learning
process); extraction is the scripted provider's, deterministic.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Episode, Fact, HitlRequestRecord, TrajectoryRecord, Turn
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.isolation import fresh_tenant_keys  # noqa: F401
from tests.processes import EngineProcesses
from tests.sse_client import execute
from tests.taskids import engine_task_id

Sessions = async_sessionmaker[AsyncSession]


def script(**kw: Any) -> str:
    return "/script " + json.dumps(kw)


async def search(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    q: str,
    *,
    kind: str = "knowledge",
    user_id: str | None = None,
    limit: int = 5,
) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"q": q, "limit": limit}
    if user_id is not None:
        params["user_id"] = user_id
    response = await client.get(
        f"{url}/memory/{kind}/search", params=params, headers={"X-Engine-Key": key}
    )
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    return results


async def learned(sessions: Sessions, turn_ids: list[str], within: float = 20.0) -> None:
    """Wait until the learning centre has learned every one of these turns."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        async with sessions() as session:
            done = await session.scalar(
                select(func.count())
                .select_from(TrajectoryRecord)
                .where(TrajectoryRecord.id.in_(turn_ids), TrajectoryRecord.status == "done")
            )
        if done == len(turn_ids):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"only {done} of {len(turn_ids)} trajectories learned in {within}s")


def turn_id(got: Any) -> str:
    return str(got.events[0]["turn_id"])


async def test_a_fact_told_in_one_task_reaches_the_next_task_and_not_another_tenant(
    engine: EngineProcesses, tenant_keys: dict[str, str], sessions: Sessions
) -> None:
    # Tenants of its own: it asserts that the tenant's brain and another
    # tenant's find nothing, whatever other tests of the run taught theirs.
    url, key, other = engine.url, tenant_keys["main"], tenant_keys["other"]
    user = f"u-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=30) as client:
        told = await execute(
            client,
            url,
            key,
            {
                "message": "My favourite climbing crag is Sintra. What should I pack?",
                "user_id": user,
            },
        )
        await learned(sessions, [turn_id(told)])
        hits = await search(client, url, key, "climbing crag", user_id=user)
        assert hits[0]["text"] == "The user's favourite climbing crag is Sintra."
        assert hits[0]["sources"] == [turn_id(told)]
        # A new task of the same brain: the fact is in the model's context.
        shown = await execute(
            client,
            url,
            key,
            {"message": script(echo_notes=True) + " where do I climb", "user_id": user},
        )
        assert "favourite climbing crag is Sintra" in shown.text
        # The episode is there too.
        episodes = await search(
            client, url, key, "climbing crag Sintra", kind="episodes", user_id=user
        )
        assert episodes and episodes[0]["trajectory_id"] == turn_id(told)
        # Another end user of the tenant, the tenant's own brain, another tenant: nothing.
        for who, brain in ((key, f"{user}-b"), (key, None), (other, user)):
            assert await search(client, url, who, "climbing crag", user_id=brain) == []
        elsewhere = await execute(
            client,
            url,
            other,
            {"message": script(echo_notes=True) + " where do I climb", "user_id": user},
        )
        assert "Sintra" not in elsewhere.text


async def test_a_contradiction_supersedes_with_history(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    url, key = engine.url, api_keys["main"]
    user = f"u-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=30) as client:
        first = await execute(
            client, url, key, {"message": "My home city is Lisbon.", "user_id": user}
        )
        await learned(sessions, [turn_id(first)])
        second = await execute(
            client, url, key, {"message": "My home city is Porto now.", "user_id": user}
        )
        await learned(sessions, [turn_id(second)])
        hits = await search(client, url, key, "home city", user_id=user)
        assert [h["text"] for h in hits] == ["The user's home city is Porto now."]
        fact = await client.get(
            f"{url}/memory/knowledge/{hits[0]['id']}",
            params={"user_id": user},
            headers={"X-Engine-Key": key},
        )
    assert fact.status_code == 200, fact.text
    history = fact.json()["history"]
    assert [h["text"] for h in history] == ["The user's home city is Lisbon."]
    assert history[0]["valid_to"] is not None and history[0]["superseded_by"] == hits[0]["id"]


async def test_every_ending_writes_a_trajectory_with_what_the_turn_did(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    url, key = engine.url, api_keys["main"]
    task = f"traj-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=30) as client:
        used_tool = await execute(
            client,
            url,
            key,
            {
                "task_id": task,
                "message": script(tool_calls=[{"name": "list_dir", "input": {}}], text="Listing."),
            },
        )
        failed = await execute(
            client, url, key, {"task_id": task, "message": script(text="x", fail="boom")}
        )
    # The terminal event reaches the client just before the turn's end (and its
    # trajectory) is committed.
    rows: dict[str, TrajectoryRecord] = {}
    deadline = time.monotonic() + 10
    while len(rows) < 2 and time.monotonic() < deadline:
        async with sessions() as session:
            rows = {
                row.id: row
                for row in (
                    await session.execute(
                        select(TrajectoryRecord).where(
                            TrajectoryRecord.id.in_([turn_id(used_tool), turn_id(failed)])
                        )
                    )
                ).scalars()
            }
        await asyncio.sleep(0.05)
    ok, bad = rows[turn_id(used_tool)], rows[turn_id(failed)]
    assert ok.outcome == "completed" and bad.outcome == "errored"
    assert ok.task_id == await engine_task_id(sessions, task)
    record = ok.record
    assert [m["role"] for m in record["messages"]][:2] == ["user", "assistant"]
    assert record["tool_calls"][0]["tool"] == "list_dir"
    assert record["tool_calls"][0]["output"] is not None
    assert record["usage"]["input_tokens"] > 0
    assert record["timings"]["active_ms"] >= 0 and record["outcome"]["status"] == "completed"
    assert bad.record["outcome"]["error"]["code"] == "LLM_PROVIDER_ERROR"


async def test_a_turn_cancelled_while_asking_records_its_question_as_cancelled(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    """The turn's end closes its pending question in the same statement that stores
    the trajectory, which must record the question as closed, not as it was read."""
    url, key = engine.url, api_keys["main"]
    headers = {"X-Engine-Key": key}
    task = f"traj-ask-{secrets.token_hex(4)}"
    ask = script(tool_calls=[{"name": "ask_user", "input": {"question": "Which one?"}}])
    async with httpx.AsyncClient(timeout=30) as client:
        turn = asyncio.create_task(execute(client, url, key, {"task_id": task, "message": ask}))
        pending: list[dict[str, Any]] = []
        deadline = time.monotonic() + 15
        while not pending and time.monotonic() < deadline:
            got = await client.get(f"{url}/hitl/pending", headers=headers, params={"task_id": task})
            pending = got.json()["pending"]
            await asyncio.sleep(0.05)
        assert pending, "the turn asked its question"
        cancel = await client.post(f"{url}/execute/cancel", headers=headers, json={"task_id": task})
        assert cancel.status_code == 200, cancel.text
        ended = await turn
    assert ended.events[-1]["stop_reason"] == "cancelled"
    row = None
    deadline = time.monotonic() + 10
    while row is None and time.monotonic() < deadline:
        async with sessions() as session:
            row = await session.get(TrajectoryRecord, turn_id(ended))
        await asyncio.sleep(0.05)
    assert row is not None and row.outcome == "cancelled"
    [question] = row.record["hitl"]
    assert question["request_id"] == pending[0]["request_id"]
    assert question["status"] == "cancelled" and question["answer"] is None
    async with sessions() as session:
        stored = await session.get(HitlRequestRecord, question["request_id"])
        queued = await session.get(Turn, turn_id(ended))
    assert stored is not None and stored.status == "cancelled"
    assert queued is not None
    assert row.record["timings"]["started_at"] == queued.created_at.isoformat()


async def test_the_social_graph_and_the_soul_are_learned(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    url, key = engine.url, api_keys["main"]
    user = f"u-{secrets.token_hex(4)}"
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(timeout=30) as client:
        said = await execute(
            client,
            url,
            key,
            {
                "message": "Marta Silva is my manager at Nordwind Labs. I prefer answers in "
                "bullet points.",
                "user_id": user,
            },
        )
        await learned(sessions, [turn_id(said)])
        people = await search(client, url, key, "Marta", kind="social", user_id=user)
        soul = await client.get(f"{url}/memory/soul", params={"user_id": user}, headers=headers)
        shown = await execute(
            client, url, key, {"message": script(echo_request=True), "user_id": user}
        )
    assert people[0]["name"] == "Marta Silva"
    assert people[0]["relations"][0]["name"] == "Nordwind Labs"
    assert soul.json()["content"] == "- The user prefers answers in bullet points."
    assert soul.json()["version"] == 1
    # The soul is in the next turn's request, in its own block.
    assert "The user prefers answers in bullet points." in json.loads(shown.text)["soul"]


async def test_the_agent_searches_and_saves_memories_with_its_tools(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    url, key = engine.url, api_keys["main"]
    user = f"u-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=30) as client:
        saved = await execute(
            client,
            url,
            key,
            {
                "user_id": user,
                "message": script(
                    tool_calls=[
                        {"name": "memory_save", "input": {"fact": "The staging host is kestrel."}}
                    ]
                ),
            },
        )
        found = await execute(
            client,
            url,
            key,
            {
                "user_id": user,
                "message": script(
                    tool_calls=[{"name": "memory_search", "input": {"query": "staging host"}}]
                ),
            },
        )
        bad = await execute(
            client,
            url,
            key,
            {
                "user_id": user,
                "message": script(
                    tool_calls=[{"name": "memory_search", "input": {"query": "x", "kind": "y"}}]
                ),
            },
        )
    result = next(e for e in saved.events if e["type"] == "tool_result")
    assert result["output"]["action"] == "created"
    result = next(e for e in found.events if e["type"] == "tool_result")
    assert result["output"]["results"][0]["text"] == "The staging host is kestrel."
    result = next(e for e in bad.events if e["type"] == "tool_result")
    assert "kind" in result["error"]


async def test_learning_keeps_up(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    """Twenty turns at once are all learned, each once."""
    url, key = engine.url, api_keys["main"]
    user = f"u-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=60) as client:
        turns = await asyncio.gather(
            *(
                execute(
                    client, url, key, {"message": f"My locker number {n} is free.", "user_id": user}
                )
                for n in range(20)
            )
        )
    ids = [turn_id(t) for t in turns]
    await learned(sessions, ids)
    async with sessions() as session:
        episodes = await session.scalar(
            select(func.count()).select_from(Episode).where(Episode.trajectory_id.in_(ids))
        )
        facts = await session.scalar(
            select(func.count()).select_from(Fact).where(Fact.user_id == user)
        )
    assert episodes == 20 and facts == 20


@pytest.mark.parametrize("kind", ["knowledge", "episodes", "social"])
async def test_search_needs_a_query(
    engine: EngineProcesses, api_keys: dict[str, str], kind: str
) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(
            f"{engine.url}/memory/{kind}/search",
            params={"q": ""},
            headers={"X-Engine-Key": api_keys["main"]},
        )
    assert response.status_code == 422


async def test_health_says_how_memory_is_searched_and_vectors_follow_the_rows(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    """Full text alone on a PostgreSQL without pgvector; with it (the embedded
    one), every learned fact also has its vector."""
    url, key = engine.url, api_keys["main"]
    user = f"u-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=30) as client:
        health = await client.get(f"{url}/health", headers={"X-Engine-Key": key})
        memory = health.json()["subsystems"]["memory"]
        said = await execute(
            client, url, key, {"message": "My kayak is a yellow Tahe.", "user_id": user}
        )
        await learned(sessions, [turn_id(said)])
    async with sessions() as session:
        has_table = await session.scalar(text("SELECT to_regclass('memory_vectors') IS NOT NULL"))
        vectors = (
            await session.scalar(
                text("SELECT count(*) FROM memory_vectors WHERE user_id = :u"), {"u": user}
            )
            if has_table
            else 0
        )
    if memory["vectors"]["status"] == "ok":
        assert memory["search"] == "full text + vectors (reciprocal rank fusion)"
        assert vectors >= 2  # the fact and the episode
    else:
        assert memory["search"] == "full text"
        assert "pgvector" in memory["vectors"]["reason"] and vectors == 0
