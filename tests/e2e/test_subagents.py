"""Subagents (#27): the delegate tool starts a child task whose events appear in
the parent's stream under the parent's cursor, and whose answer is the call's
result. Real processes, scripted model: a brief that is a ``/script`` makes the
child's model follow it."""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Task, Turn
from httpx_sse import aconnect_sse
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.e2e import test_recovery
from tests.e2e.test_recovery import owner_of, process_of
from tests.processes import EngineProcesses
from tests.sse_client import execute, replay
from tests.taskids import engine_task_id

pytestmark = [pytest.mark.timeout(120)]

# One gateway, two loop-workers and a tool-runner, with a 2 s lease: the kill tests'.
cluster = test_recovery.cluster


def script(**kw: Any) -> str:
    return "/script " + json.dumps(kw)


def delegating(*children: tuple[str, str]) -> str:
    """A parent's message: one delegate call per (agent, brief), in one response."""
    calls = [{"name": "delegate", "input": {"agent": a, "brief": b}} for a, b in children]
    return script(tool_calls=calls)


def of_call(events: list[dict[str, Any]], call_id: str) -> list[dict[str, Any]]:
    return [e for e in events if (e.get("subagent") or {}).get("tool_call_id") == call_id]


def assert_gapless(events: list[dict[str, Any]]) -> None:
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "gapless, no duplicate"


async def child_events(
    client: httpx.AsyncClient, base: str, key: str, name: str
) -> list[dict[str, Any]]:
    got = await replay(client, base, key, {"task_id": name, "after": 0})
    assert got.status == 200, got.body
    return got.events


async def test_two_children_run_at_once_and_stream_under_the_parents_cursor(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"delegate-{secrets.token_hex(3)}"
    message = delegating(
        ("researcher", script(text="fact ", deltas=30, delay_ms=15)),
        ("writer", script(text="prose ", deltas=30, delay_ms=15)),
    )
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(client, engine.url, key, {"message": message, "task_id": task_id})
        events = got.events
        assert events[-1]["type"] == "thread_lifecycle" and events[-1]["phase"] == "completed"
        assert_gapless(events)
        assert {e["task_id"] for e in events} == {task_id}
        calls = [e for e in events if e["type"] == "tool_call"]
        assert [c["tool"] for c in calls] == ["delegate", "delegate"]
        started = [e for e in events if e["type"] == "subagent_started"]
        completed = [e for e in events if e["type"] == "subagent_completed"]
        assert len(started) == len(completed) == 2
        answers = {}
        for call, agent, word in zip(
            calls, ("researcher", "writer"), ("fact ", "prose "), strict=True
        ):
            mine = of_call(events, call["tool_call_id"])
            origin = mine[0]["subagent"]
            assert origin["agent"] == agent and origin["depth"] == 1
            assert (
                mine[0]["type"] == "subagent_started" and mine[-1]["type"] == "subagent_completed"
            )
            assert mine[-1]["status"] == "completed" and mine[-1]["answer"] == word * 30
            deltas = [e for e in mine if e["type"] == "text_delta"]
            assert "".join(d["text"] for d in deltas) == word * 30
            # Each child event once, in the child's order, with the child's seq.
            child_seqs = [e["subagent"]["seq"] for e in mine[1:-1]]
            assert child_seqs == sorted(set(child_seqs))
            # The child is a task of its own, its log the same events.
            own = await child_events(client, engine.url, key, origin["task_id"])
            mirrored = {e["seq"] for e in own if e["type"] != "thread_lifecycle"}
            assert set(child_seqs) == mirrored
            detail = await client.get(
                f"{engine.url}/tasks/{origin['task_id']}", headers={"X-Engine-Key": key}
            )
            assert detail.status_code == 200 and detail.json()["agent"] == agent
            answers[call["tool_call_id"]] = word * 30
        results = {e["tool_call_id"]: e for e in events if e["type"] == "tool_result"}
        assert {k: r["output"] for k, r in results.items()} == answers
        # At once: the second child's first delta comes before the first child's last.
        first, second = (
            [e["seq"] for e in of_call(events, c["tool_call_id"]) if e["type"] == "text_delta"]
            for c in calls
        )
        assert min(second) < max(first) and min(first) < max(second)
        # The parent's model saw both answers (its own text: events without ``subagent``).
        own_text = "".join(
            e["text"] for e in events if e["type"] == "text_delta" and not e.get("subagent")
        )
        assert own_text.startswith("Tool results:")
        assert all(json.dumps({"output": a}) in own_text for a in answers.values())
        # The parent's usage names each child's (each child's own task counts it).
        usage = [e for e in events if e["type"] == "usage" and not e.get("subagent")][-1]
        children = {e["subagent"]["task_id"] for e in started}
        assert set(usage["subagents"]) == children
        assert all(u["output_tokens"] > 0 for u in usage["subagents"].values())
        # A replay from any cursor gives the same interleaving.
        middle = events[len(events) // 2]["seq"]
        again = await replay(client, engine.url, key, {"task_id": task_id, "after_seq": middle})
        assert again.events == [e for e in events if e["seq"] > middle]
        # Deleting the parent deletes its subagents' tasks.
        headers = {"X-Engine-Key": key}
        gone = await client.delete(f"{engine.url}/tasks/{task_id}", headers=headers)
        assert gone.status_code == 200, gone.text
        for child in children:
            missing = await client.get(f"{engine.url}/tasks/{child}", headers=headers)
            assert missing.status_code == 404, missing.text


async def test_refusals_are_the_calls_results(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"delegate-refused-{secrets.token_hex(3)}"
    message = delegating(("general", "anything"), ("researcher", "  "))
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(client, engine.url, key, {"message": message, "task_id": task_id})
    results = [e for e in got.events if e["type"] == "tool_result"]
    assert "unknown subagent 'general'" in results[0]["error"]
    assert "brief is empty" in results[1]["error"]
    assert "subagent_started" not in got.types
    assert got.events[-1]["phase"] == "completed"


async def test_delegation_stops_at_the_depth_limit(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    """A custom agent that delegates to itself: depth 1 and 2 delegate, depth 3 is refused."""
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    agent = f"recursive-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        made = await client.post(
            f"{engine.url}/agents",
            headers=headers,
            json={
                "name": agent,
                "description": "delegates to itself",
                "system_prompt": "You delegate.",
                "tools": ["ask_user"],
                "subagents": [agent],
            },
        )
        assert made.status_code == 201, made.text
        assert made.json()["subagents"] == [agent] and "delegate" in made.json()["tools"]
        bad = await client.post(
            f"{engine.url}/agents",
            headers=headers,
            json={
                "name": f"{agent}-x",
                "description": "d",
                "system_prompt": "p",
                "subagents": ["no-such-agent"],
            },
        )
        assert bad.status_code == 422 and bad.json()["details"]["errors"][0]["loc"] == [
            "body",
            "subagents",
            "0",
        ]
        innermost = delegating((agent, "too deep"))
        brief = innermost
        for _ in range(2):
            brief = delegating((agent, brief))
        body = {"message": brief, "task_id": f"deep-{secrets.token_hex(3)}", "agent": agent}
        got = await execute(client, engine.url, key, body)
    events = got.events
    assert got.events[-1]["phase"] == "completed"
    depths = sorted({e["subagent"]["depth"] for e in events if e.get("subagent")})
    assert depths == [1, 2]
    refused = [
        e
        for e in events
        if e["type"] == "tool_result" and "HOLDFAST_MAX_SUBAGENT_DEPTH" in (e.get("error") or "")
    ]
    # Born at depth 2, mirrored through depth 1 into the parent.
    assert len(refused) == 1 and refused[0]["subagent"]["depth"] == 2


async def test_cancelling_the_parent_cancels_its_child(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: async_sessionmaker[AsyncSession]
) -> None:
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    task_id = f"delegate-cancel-{secrets.token_hex(3)}"
    message = delegating(("researcher", script(text="slow ", deltas=500, delay_ms=20)))
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(client, engine.url, key, {"message": message, "task_id": task_id})
        )
        child = await _child_streaming(client, engine.url, key, task_id)
        answer = await client.post(
            f"{engine.url}/execute/cancel", json={"task_id": task_id}, headers=headers
        )
        assert answer.status_code == 200, answer.text
        got = await live
        assert got.events[-1]["stop_reason"] == "cancelled"
        own = await _until_ended(client, engine.url, key, child)
    assert own[-1]["phase"] == "completed" and own[-1]["stop_reason"] == "cancelled"
    deltas = [e for e in own if e["type"] == "text_delta"]
    assert 0 < len(deltas) < 500


async def test_a_childs_question_is_answered_through_the_parent(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    task_id = f"delegate-ask-{secrets.token_hex(3)}"
    ask = script(tool_calls=[{"name": "ask_user", "input": {"question": "Colour?"}}])
    message = delegating(("researcher", ask))
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(client, engine.url, key, {"message": message, "task_id": task_id})
        )
        question = await _mirrored_question(client, engine.url, key, task_id)
        assert question["question"] == "Colour?" and question["subagent"]["agent"] == "researcher"
        answered = await client.post(
            f"{engine.url}/hitl/respond",
            headers=headers,
            json={"task_id": task_id, "request_id": question["request_id"], "answer": "teal"},
        )
        assert answered.status_code == 200, answered.text
        got = await live
    assert got.events[-1]["phase"] == "completed"
    result = next(e for e in got.events if e["type"] == "tool_result" and not e.get("subagent"))
    assert "teal" in result["output"]
    resolved = [e for e in got.events if e["type"] == "hitl_resolved"]
    assert (
        len(resolved) == 1 and resolved[0]["subagent"]["task_id"] == question["subagent"]["task_id"]
    )


async def _mirrored_question(
    client: httpx.AsyncClient, base: str, key: str, task_id: str
) -> dict[str, Any]:
    """The child's question, as the parent's stream (followed live) shows it."""
    await engine_task_id_of(client, base, key, task_id)
    url = f"{base}/execute/replay"
    params = {"task_id": task_id, "after_seq": 0}
    async with aconnect_sse(
        client, "GET", url, params=params, headers={"X-Engine-Key": key}
    ) as source:
        async for sse in source.aiter_sse():
            event = json.loads(sse.data)
            if event["type"] == "hitl_request" and event.get("subagent"):
                return dict(event)
    raise AssertionError("no question from the child reached the parent's stream")


async def engine_task_id_of(client: httpx.AsyncClient, base: str, key: str, task_id: str) -> None:
    """Returns once the task exists (its first turn was accepted)."""
    for _ in range(400):
        got = await client.get(f"{base}/tasks/{task_id}", headers={"X-Engine-Key": key})
        if got.status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"task {task_id} never appeared")


async def _child_streaming(client: httpx.AsyncClient, base: str, key: str, task_id: str) -> str:
    """The name of the parent's child once its text shows in the parent's stream."""
    for _ in range(400):
        got = await replay(client, base, key, {"task_id": task_id, "after": 0}, limit=64)
        for event in got.events:
            if event["type"] == "text_delta" and event.get("subagent"):
                return str(event["subagent"]["task_id"])
        await asyncio.sleep(0.05)
    raise AssertionError("the child never streamed")


async def _until_ended(
    client: httpx.AsyncClient, base: str, key: str, name: str
) -> list[dict[str, Any]]:
    for _ in range(400):
        events = await child_events(client, base, key, name)
        if events and events[-1]["type"] == "thread_lifecycle" and events[-1]["phase"] != "started":
            return events
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never ended")


# -- kill -9 ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["parent", "child"])
async def test_a_killed_worker_neither_loses_nor_doubles_a_child(
    cluster: EngineProcesses,
    api_keys: dict[str, str],
    sessions: async_sessionmaker[AsyncSession],
    victim: str,
) -> None:
    """SIGKILL of the worker running the parent turn (or the child's) while the
    child streams: the turns go on elsewhere, one child task, and the parent's
    stream holds each of the child's events once."""
    key = api_keys["main"]
    task_id = f"delegate-kill-{victim}-{secrets.token_hex(3)}"
    message = delegating(("researcher", script(text="w ", deltas=150, delay_ms=30)))
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(client, cluster.url, key, {"message": message, "task_id": task_id})
        )
        child = await _child_streaming(client, cluster.url, key, task_id)
        killed = task_id if victim == "parent" else child
        turn_id = await _running_turn_of(sessions, killed)
        cluster.kill(process_of(cluster, await owner_of(sessions, turn_id) or ""))
        cluster.start_worker()
        got = await live
        own = await _until_ended(client, cluster.url, key, child)
    events = got.events
    assert events[-1]["phase"] == "completed", events[-3:]
    assert_gapless(events)
    resumed = [e for e in events if e["type"] == "turn_resumed"]
    # The killed turn went on elsewhere: the parent's own resume, or the child's,
    # mirrored (the other turn too, when both ran on the killed worker).
    assert (victim == "child") in {bool(e.get("subagent")) for e in resumed}, resumed
    mirrored = [e for e in events if e.get("subagent") and "seq" in e["subagent"]]
    child_seqs = [e["subagent"]["seq"] for e in mirrored]
    assert len(child_seqs) == len(set(child_seqs)), "no child event twice"
    assert set(child_seqs) == {e["seq"] for e in own if e["type"] != "thread_lifecycle"}
    assert [e["type"] for e in events].count("subagent_completed") == 1
    parent_id = await engine_task_id(sessions, task_id, wait=5)
    async with sessions() as session:
        children = await session.scalar(
            select(func.count()).select_from(Task).where(Task.parent_task_id == parent_id)
        )
    assert children == 1, "the child was started once"
    # The child's own text as its client would show it: its turn_resumed (when
    # its worker was the one killed) takes back the cut-off call's deltas.
    result = next(e for e in events if e["type"] == "tool_result")
    assert result["output"] == "w " * 150


async def _running_turn_of(sessions: async_sessionmaker[AsyncSession], name: str) -> str:
    task = await engine_task_id(sessions, name, wait=5)
    for _ in range(200):
        async with sessions() as session:
            turn_id = await session.scalar(
                select(Turn.id).where(Turn.task_id == task, Turn.status == "running")
            )
        if turn_id:
            return str(turn_id)
        await asyncio.sleep(0.05)
    raise AssertionError(f"no running turn of {name}")


async def test_files_named_by_the_call_are_copied_into_the_childs_workspace(
    cluster: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    task_id = f"delegate-files-{secrets.token_hex(3)}"
    files = {
        "notes/plan.md": b"step one",
        "data/a.txt": b"alpha",
        "data/sub/b.txt": b"beta",
        "other.txt": b"not handed on",
    }
    reads = [
        {"name": "read_file", "input": {"path": p}} for p in ("notes/plan.md", "data/sub/b.txt")
    ]
    call = {"agent": "researcher", "brief": script(tool_calls=reads)}
    async with httpx.AsyncClient(timeout=60) as client:
        first = await execute(client, cluster.url, key, {"message": "hello", "task_id": task_id})
        assert first.events[-1]["phase"] == "completed"
        for path, content in files.items():
            put = await client.put(
                f"{cluster.url}/tasks/{task_id}/files/{path}", headers=headers, content=content
            )
            assert put.status_code == 201, put.text
        message = script(
            tool_calls=[
                {"name": "delegate", "input": {**call, "files": ["notes/plan.md", "/data/"]}}
            ]
        )
        got = await execute(client, cluster.url, key, {"message": message, "task_id": task_id})
        assert got.events[-1]["phase"] == "completed", got.events[-3:]
        result = next(e for e in got.events if e["type"] == "tool_result" and not e.get("subagent"))
        assert "step one" in result["output"] and "beta" in result["output"], result
        child = next(e for e in got.events if e["type"] == "subagent_started")["subagent"]
        listed = await client.get(
            f"{cluster.url}/tasks/{child['task_id']}/files",
            headers=headers,
            params={"recursive": "true"},
        )
        assert listed.status_code == 200, listed.text
        copied = {f["path"] for f in listed.json()["files"] if f["kind"] == "file"}
        assert copied == {"notes/plan.md", "data/a.txt", "data/sub/b.txt"}

        # A path the parent's workspace has not: the call's result says which,
        # and no child turn runs.
        missing = script(
            tool_calls=[{"name": "delegate", "input": {**call, "files": ["nowhere.txt"]}}]
        )
        got = await execute(client, cluster.url, key, {"message": missing, "task_id": task_id})
    assert got.events[-1]["phase"] == "completed"
    result = next(e for e in got.events if e["type"] == "tool_result")
    assert "nowhere.txt" in (result.get("error") or ""), result
    assert not [e for e in got.events if e.get("subagent")]
