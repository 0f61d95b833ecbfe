"""The context engine in a real engine: a task never dies of its own length.

The scripted model refuses a request larger than ``SCRIPTED_CONTEXT_WINDOW``
the way real APIs do, so "every request fits" is checked by the model
itself, call by call.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import ContextSummary, Message
from holdfast_shared.keys import Keys
from redis.asyncio import Redis
from sqlalchemy import func, select

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import Received, execute
from tests.taskids import engine_task_id

# Room for the fixed sections (the default agent's system prompt and its tools,
# ~1,300 tokens) and about as much again for the conversation before compacting.
WINDOW = 4700


def script(**kw: Any) -> str:
    return "/script " + json.dumps(kw)


def by_type(got: Received, event_type: str) -> list[dict[str, Any]]:
    return [e for e in got.events if e["type"] == event_type]


@pytest.fixture(scope="module")
def small_window(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """An engine whose model has a 4,700-token window, two workers, a 2 s lease."""
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}ctx:",
        HOLDFAST_CONTEXT_WINDOW=str(WINDOW),
        SCRIPTED_CONTEXT_WINDOW=str(WINDOW),
        SCRIPTED_SUMMARY_DELAY_MS="1500",
        HOLDFAST_LEASE_SECONDS="2",
        HOLDFAST_TOOL_PERMISSIONS=json.dumps({"*": {"bash": "allow"}}),
        HOLDFAST_WORKSPACE_ROOT=str(tmp_path_factory.mktemp("ctx-workspaces")),
    )
    with running_engine(env, workers=2, runners=1) as procs:
        yield procs


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_300_message_task_fits_its_window(
    small_window: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    key = api_keys["main"]
    task_id = f"long-{secrets.token_hex(3)}"
    turns: list[Received] = []
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(150):
            if i % 15 == 7:  # now and then a tool call, whose pair a cut must not split
                message = script(
                    text=f"step {i}",
                    tool_calls=[{"name": "list_dir", "input": {}}],
                )
            else:
                message = f"message {i}: " + "the quick brown fox jumps over the lazy dog " * 4
            got = await execute(
                client, small_window.url, key, {"message": message, "task_id": task_id}
            )
            assert got.events[-1]["phase"] == "completed", got.events[-4:]
            turns.append(got)
    compactions = [e for got in turns for e in by_type(got, "compaction_event")]
    assert compactions, "the task outgrew its window without a compaction"
    for event in compactions:
        assert event["tokens_after"] < event["tokens_before"]
        assert event["summarized_messages"] >= 2 and event["summary_tokens"] > 0
    # Each turn's calls fit: the model refused none, and reported their sizes.
    for got in turns:
        for usage in by_type(got, "usage"):
            assert usage["model"] == "scripted:scripted"
        assert "error" not in got.types
    # The turn after a compaction sees the summary.
    after = next(i for i, got in enumerate(turns) if by_type(got, "compaction_event"))
    assert "[summary in context]" in turns[after].text
    engine_id = await engine_task_id(sessions, task_id)
    async with sessions() as session:
        stored = await session.scalar(
            select(func.count()).select_from(Message).where(Message.task_id == engine_id)
        )
        summaries = (
            await session.execute(
                select(ContextSummary.last_message_id).where(ContextSummary.task_id == engine_id)
            )
        ).all()
    assert stored >= 300, "every message stays, for replay and export"
    assert len(summaries) == len({row[0] for row in summaries}) == len(compactions)


async def _fill(client: httpx.AsyncClient, url: str, key: str, task_id: str, until: int) -> None:
    """Turns until the next one would compact (the context is near the threshold)."""
    for i in range(until):
        message = f"filler {i}: " + "lorem ipsum dolor sit amet " * 8
        got = await execute(client, url, key, {"message": message, "task_id": task_id})
        assert got.events[-1]["phase"] == "completed"
        if by_type(got, "compaction_event"):
            return


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_worker_killed_during_compaction_leaves_one_summary(
    small_window: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    key = api_keys["main"]
    task_id = f"kill-compact-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        await _fill(client, small_window.url, key, task_id, 200)  # the first compaction
        engine_id = await engine_task_id(sessions, task_id)
        async with sessions() as session:
            before = await session.scalar(
                select(func.count())
                .select_from(ContextSummary)
                .where(ContextSummary.task_id == engine_id)
            )
        # Fill again until the next turn compacts; that turn is the one to kill.
        for i in range(200):
            live = asyncio.create_task(
                execute(
                    client,
                    small_window.url,
                    key,
                    {"message": f"more {i}: " + "lorem ipsum " * 30, "task_id": task_id},
                )
            )
            # The summary call sleeps 1.5 s: a turn that takes longer is compacting.
            done, _ = await asyncio.wait({live}, timeout=0.7)
            if done:
                assert live.result().events[-1]["phase"] == "completed"
                continue
            victim = _worker_running(small_window, sessions, engine_id)
            os.kill(await victim, signal.SIGKILL)
            got = await asyncio.wait_for(live, 60)
            break
        else:
            raise AssertionError("no turn compacted")
    assert got.events[-1]["phase"] == "completed", got.events[-5:]
    assert "turn_resumed" in got.types
    async with sessions() as session:
        rows = (
            await session.execute(
                select(ContextSummary.last_message_id).where(ContextSummary.task_id == engine_id)
            )
        ).all()
    ranges = [row[0] for row in rows]
    assert len(ranges) == len(set(ranges)) == before + 1, "exactly one summary for the range"
    small_window.workers[:] = [p for p in small_window.workers if p.poll() is None]
    small_window.start_worker()


async def _worker_running(procs: EngineProcesses, sessions: Any, task_id: str) -> int:
    """The pid of the worker holding the task's running turn."""
    from holdfast_shared.db.models import Turn

    for _ in range(100):
        async with sessions() as session:
            owner = await session.scalar(
                select(Turn.lease_owner).where(Turn.task_id == task_id, Turn.status == "running")
            )
        if owner:
            return int(owner.rsplit("-", 1)[1])
        await asyncio.sleep(0.05)
    raise AssertionError("no worker holds the turn")


async def test_working_memory_survives_turns_and_the_redis_copy(
    small_window: EngineProcesses,
    api_keys: dict[str, str],
    sessions: Any,
    redis: Redis,
    redis_prefix: str,
) -> None:
    key = api_keys["main"]
    task_id = f"wm-{secrets.token_hex(3)}"
    headers = {"X-Engine-Key": key}
    set_plan = script(
        tool_calls=[
            {
                "name": "working_memory",
                "input": {"action": "set", "key": "plan", "value": "step 2"},
            },
            {"name": "working_memory", "input": {"action": "set", "key": "owner", "value": "Ada"}},
        ]
    )
    async with httpx.AsyncClient(timeout=60) as client:
        first = await execute(
            client, small_window.url, key, {"message": set_plan, "task_id": task_id}
        )
        updates = by_type(first, "working_memory_update")
        assert [(u["key"], u["value"]) for u in updates] == [("plan", "step 2"), ("owner", "Ada")]
        drop = script(
            tool_calls=[{"name": "working_memory", "input": {"action": "delete", "key": "owner"}}]
        )
        second = await execute(client, small_window.url, key, {"message": drop, "task_id": task_id})
        deleted = by_type(second, "working_memory_update")[0]
        assert deleted["key"] == "owner" and "value" in deleted and deleted["value"] is None
        shown = await execute(
            client, small_window.url, key, {"message": script(echo_notes=True), "task_id": task_id}
        )
        assert "plan: step 2" in shown.text and "owner" not in shown.text
        read = await client.get(
            f"{small_window.url}/tasks/{task_id}/working-memory", headers=headers
        )
        assert read.json() == {"task_id": task_id, "working_memory": {"plan": "step 2"}}
        # The live copy expires; the next turn finds what the last one left in PostgreSQL.
        engine_id = await engine_task_id(sessions, task_id)
        await redis.delete(Keys(f"{redis_prefix}ctx:").working_memory(engine_id))
        again = await execute(
            client, small_window.url, key, {"message": script(echo_notes=True), "task_id": task_id}
        )
        assert "plan: step 2" in again.text
        other = await client.get(
            f"{small_window.url}/tasks/{task_id}/working-memory",
            headers={"X-Engine-Key": api_keys["other"]},
        )
        assert other.status_code == 404


@pytest.mark.parametrize(
    ("setting", "value", "said"),
    [
        ("HOLDFAST_COMPACTION_THRESHOLD", "1.5", "compaction_threshold"),
        ("HOLDFAST_COMPACTION_THRESHOLD", "0", "compaction_threshold"),
        ("HOLDFAST_COMPACTION_MODEL", "nosuch:model", "unknown model provider"),
    ],
)
def test_bad_context_settings_stop_the_worker_at_start(
    redis_url: str, database_url: str, redis_prefix: str, setting: str, value: str, said: str
) -> None:
    env = engine_env(redis_url, database_url, f"{redis_prefix}bad:", **{setting: value})
    done = subprocess.run(
        [sys.executable, "-m", "holdfast", "loop-worker"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert said in done.stdout + done.stderr, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_working_memory_survives_a_takeover(
    small_window: EngineProcesses,
    api_keys: dict[str, str],
    sessions: Any,
    redis: Redis,
    redis_prefix: str,
) -> None:
    key = api_keys["main"]
    task_id = f"wm-takeover-{secrets.token_hex(3)}"
    message = script(
        tool_calls=[
            {"name": "working_memory", "input": {"action": "set", "key": "plan", "value": "B"}},
            {"name": "bash", "input": {"command": "sleep 3; echo slept"}},
        ]
    )
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(client, small_window.url, key, {"message": message, "task_id": task_id})
        )
        engine_id = await engine_task_id(sessions, task_id, wait=10)
        wm_key = Keys(f"{redis_prefix}ctx:").working_memory(engine_id)
        for _ in range(200):  # the note is set; the bash call is running
            if await redis.exists(wm_key):
                break
            await asyncio.sleep(0.02)
        os.kill(await _worker_running(small_window, sessions, engine_id), signal.SIGKILL)
        # The live copy is lost too: only the turn's snapshot still has the note.
        await redis.delete(wm_key)
        got = await asyncio.wait_for(live, 60)
        assert got.events[-1]["phase"] == "completed" and "turn_resumed" in got.types
        assert await redis.hget(wm_key, "plan") == "B", "the resumed turn published it again"
        shown = await execute(
            client, small_window.url, key, {"message": script(echo_notes=True), "task_id": task_id}
        )
    assert "plan: B" in shown.text
    small_window.start_worker()
