"""Turns survive their processes: worker kills, tool-runner kills, full restarts, drain,
cancel and deadlines — real processes, SIGKILL and SIGTERM."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Turn
from sqlalchemy import select

from holdfast.testing import Process
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import Received, execute, replay, stream
from tests.taskids import engine_task_id, workspace_of
from tests.waiting import logged, until_file, until_logged

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

# A built-in agent (agents must exist); the operator makes its bash ask below.
ASKER = "coder"


@pytest.fixture(scope="module")
def cluster(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """One gateway, two loop-workers and a tool-runner, with a 2 s lease."""
    workspaces = tmp_path_factory.mktemp("recovery-workspaces")
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}recovery:",
        HOLDFAST_LEASE_SECONDS="2",
        HOLDFAST_DRAIN_SECONDS="1",
        HOLDFAST_TOOL_CLAIM_IDLE_SECONDS="3",
        HOLDFAST_WORKSPACE_ROOT=str(workspaces),
        HOLDFAST_TOOL_PERMISSIONS=json.dumps({"*": {"bash": "allow"}, ASKER: {"bash": "ask"}}),
    )
    with running_engine(
        env, workers=2, runners=1, directory=tmp_path_factory.mktemp("recovery")
    ) as procs:
        procs.workspaces = workspaces  # type: ignore[attr-defined]
        yield procs


def script(**kw: Any) -> str:
    return "/script " + json.dumps(kw)


def visible_text(events: list[dict[str, Any]]) -> str:
    """The text a client shows: deltas minus the ranges a turn_resumed discards."""
    dropped: set[int] = set()
    for event in events:
        if event["type"] == "turn_resumed" and event.get("discard_from_seq"):
            dropped.update(range(event["discard_from_seq"], event["discard_to_seq"] + 1))
    return "".join(
        e["text"] for e in events if e["type"] == "text_delta" and e["seq"] not in dropped
    )


def assert_whole(events: list[dict[str, Any]]) -> None:
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "gapless, no duplicate"
    terminal = [e for e in events if e["type"] == "thread_lifecycle" and e["phase"] != "started"]
    assert len(terminal) == 1 and terminal[0] is events[-1]


async def owner_of(sessions: Any, turn_id: str) -> str | None:
    for _ in range(100):
        async with sessions() as session:
            owner = await session.scalar(select(Turn.lease_owner).where(Turn.id == turn_id))
        if owner:
            return str(owner)
        await asyncio.sleep(0.05)
    return None


def process_of(cluster: EngineProcesses, owner: str) -> Process:
    pid = int(owner.rsplit("-", 1)[1])
    return next(p for p in cluster.workers if p.pid == pid)


async def test_worker_killed_mid_stream_the_turn_goes_on(
    cluster: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    key = api_keys["main"]
    # About 8 s of answer: on a loaded machine the look-ups before the kill take
    # seconds, and a turn that ended first is no kill mid-stream.
    message = script(text="word ", deltas=200, delay_ms=40)
    task_id = f"stream-kill-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(client, cluster.url, key, {"message": message, "task_id": task_id})
        )
        # Killed once some deltas are out, however long the worker took to start.
        await _until_text_streams(client, cluster.url, key, task_id)
        turn_id = await _running_turn(sessions, task_id)
        victim = process_of(cluster, await owner_of(sessions, turn_id) or "")
        cluster.kill(victim)
        cluster.start_worker()
        got = await live
    assert_whole(got.events)
    resumed = [e for e in got.events if e["type"] == "turn_resumed"]
    assert len(resumed) == 1 and resumed[0]["reason"] == "worker_lost"
    assert resumed[0]["discard_from_seq"] <= resumed[0]["discard_to_seq"] < resumed[0]["seq"]
    assert visible_text(got.events) == "word " * 200
    assert got.events[-1]["phase"] == "completed"


async def _until_text_streams(client: httpx.AsyncClient, base: str, key: str, task_id: str) -> None:
    """Returns once the task's log holds a text delta (a replay that follows it live)."""
    for _ in range(100):
        got = await replay(client, base, key, {"task_id": task_id, "after": 0}, limit=8)
        if got.status == 200 and "text_delta" in got.types:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the turn never streamed text")


async def _running_turn(sessions: Any, task: str) -> str:
    """The running turn of the task named ``task`` (another test's may run too)."""
    task_id = await engine_task_id(sessions, task, wait=5)
    for _ in range(100):
        async with sessions() as session:
            turn_id = await session.scalar(
                select(Turn.id)
                .where(Turn.status == "running", Turn.task_id == task_id)
                .order_by(Turn.created_at.desc())
            )
        if turn_id:
            return str(turn_id)
        await asyncio.sleep(0.05)
    raise AssertionError("no running turn")


async def test_worker_killed_during_a_tool_call_does_not_repeat_it(
    cluster: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    key = api_keys["main"]
    task_id = f"tool-kill-{secrets.token_hex(3)}"
    # effects.log says the tool started, finished.log that it ended: the kill
    # must land between the two.
    command = "echo ran >> effects.log; sleep 3; echo done; touch finished.log"
    message = script(tool_calls=[{"name": "bash", "input": {"command": command}}])
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(client, cluster.url, key, {"message": message, "task_id": task_id})
        )
        workspace = await workspace_of(sessions, cluster.workspaces, task_id)  # type: ignore[attr-defined]
        await until_logged(client, cluster.url, key, task_id, logged("tool_call"), "no tool_call")
        await until_file(workspace / "effects.log", "the tool never started")
        turn_id = await _running_turn(sessions, task_id)
        victim = process_of(cluster, await owner_of(sessions, turn_id) or "")
        cluster.kill(victim)
        assert not (workspace / "finished.log").exists(), "killed after the tool, not during it"
        cluster.start_worker()
        got = await live
    assert_whole(got.events)
    effects = (workspace / "effects.log").read_text()
    assert effects == "ran\n", "the tool ran exactly once"
    results = [e for e in got.events if e["type"] == "tool_result"]
    assert len(results) == 1 and results[0]["output"]["stdout"] == "done\n"
    resumed = [e for e in got.events if e["type"] == "turn_resumed"]
    assert len(resumed) == 1 and resumed[0]["reason"] == "worker_lost"
    call = next(e for e in got.events if e["type"] == "tool_call")
    assert call["seq"] < resumed[0]["seq"] < results[0]["seq"], "taken over while the tool ran"
    assert got.events[-1]["phase"] == "completed"


async def test_tool_runner_killed_mid_call_is_settled_not_rerun(
    cluster: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    key = api_keys["main"]
    task_id = f"runner-kill-{secrets.token_hex(3)}"
    command = "echo ran >> effects.log; sleep 5; echo done"
    message = script(tool_calls=[{"name": "bash", "input": {"command": command}}])
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(client, cluster.url, key, {"message": message, "task_id": task_id})
        )
        workspace = await workspace_of(sessions, cluster.workspaces, task_id)  # type: ignore[attr-defined]
        log = workspace / "effects.log"
        await until_file(log, "the tool never started")
        cluster.kill(cluster.runners[0])
        cluster.start_tool_runner()
        # bash is effectful: nobody knows whether it took effect, so a person is
        # asked (#26; tests/e2e/test_tool_effects.py has each answer).
        await until_logged(client, cluster.url, key, task_id, logged("hitl_request"), "no ask")
        answered = await client.post(
            f"{cluster.url}/hitl/respond",
            json={"task_id": task_id, "answer": "failed"},
            headers={"X-Engine-Key": key},
        )
        assert answered.status_code == 200, answered.text
        got = await live
    assert_whole(got.events)
    assert log.read_text() == "ran\n", "the lost call was not run again"
    assert got.types.count("tool_outcome_unknown") == 1
    result = next(e for e in got.events if e["type"] == "tool_result")
    assert "did not take effect" in result["error"]
    assert got.events[-1]["phase"] == "completed"


async def test_parked_question_survives_a_full_restart(
    cluster: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    key = api_keys["main"]
    task_id = f"parked-{secrets.token_hex(3)}"
    message = script(tool_calls=[{"name": "bash", "input": {"command": "echo answered"}}])
    async with httpx.AsyncClient(timeout=60) as client:
        first = await stream(
            client,
            "POST",
            f"{cluster.url}/execute",
            key=key,
            limit=6,
            json={"message": message, "task_id": task_id, "agent": ASKER},
        )
        request = first.events[-1]
        assert request["type"] == "hitl_request"
        for _ in range(100):  # the worker parks right after emitting the request
            async with sessions() as session:
                status = await session.scalar(
                    select(Turn.status).where(Turn.id == request["turn_id"])
                )
            if status == "parked":
                break
            await asyncio.sleep(0.05)
        assert status == "parked", "no worker holds a parked turn"

        cluster.kill_all()
        cluster.start_tool_runner()
        cluster.start_worker()
        cluster.start_gateway()

        pending = (
            await client.get(f"{cluster.url}/hitl/pending", headers={"X-Engine-Key": key})
        ).json()["pending"]
        assert request["request_id"] in [p["request_id"] for p in pending]
        # A client reopened later sees the question in the replay.
        reopened = await replay(
            client, cluster.url, key, {"task_id": task_id}, limit=len(first.events)
        )
        assert reopened.events[-1]["request_id"] == request["request_id"]
        answer = await client.post(
            f"{cluster.url}/hitl/respond",
            json={"task_id": task_id, "request_id": request["request_id"], "answer": "yes"},
            headers={"X-Engine-Key": key},
        )
        assert answer.status_code == 200
        rest = await replay(
            client, cluster.url, key, {"task_id": task_id, "after_seq": len(first.events)}
        )
    events = first.events + rest.events
    assert_whole(events)
    types = [e["type"] for e in rest.events]
    # A worker killed right after parking, before it acknowledged the job, has
    # its job taken over too: that resume finds the question still open and
    # parks again (one more turn_resumed, no second question).
    first_other = next(i for i, t in enumerate(types) if t != "turn_resumed")
    assert first_other >= 1 and types[first_other] == "hitl_resolved", types
    assert [e["type"] for e in events].count("hitl_request") == 1
    assert next(e for e in rest.events if e["type"] == "tool_result")["output"]["stdout"] == (
        "answered\n"
    )
    assert events[-1]["phase"] == "completed"


async def test_cancel_stops_a_running_turn_and_the_task_goes_on(
    cluster: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"cancel-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(
                client,
                cluster.url,
                key,
                {"message": script(text="x ", deltas=100, delay_ms=50), "task_id": task_id},
            )
        )
        await until_logged(client, cluster.url, key, task_id, logged("text_delta"), "no text")
        response = await client.post(
            f"{cluster.url}/execute/cancel",
            json={"task_id": task_id},
            headers={"X-Engine-Key": key},
        )
        got = await live
        idle = await client.post(
            f"{cluster.url}/execute/cancel",
            json={"task_id": task_id},
            headers={"X-Engine-Key": key},
        )
        after = await execute(client, cluster.url, key, {"message": "next", "task_id": task_id})
    assert response.status_code == 200 and response.json()["status"] == "cancelling"
    assert_whole(got.events)
    assert got.events[-1] == {**got.events[-1], "phase": "completed", "stop_reason": "cancelled"}
    assert got.types.count("text_delta") < 100
    assert got.types[-3:-1] == ["content_block_stop", "usage"]
    assert idle.status_code == 409 and idle.json()["error"] == "NO_RUNNING_TURN"
    assert after.events[-1]["phase"] == "completed"


async def test_sigterm_drains_then_hands_the_turn_back(
    cluster: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    key = api_keys["main"]
    task_id = f"drain-{secrets.token_hex(3)}"
    message = script(text="d ", deltas=60, delay_ms=50)
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(
            execute(client, cluster.url, key, {"message": message, "task_id": task_id})
        )
        # Mid-stream: a turn the worker is still setting up is not one it hands back.
        await until_logged(client, cluster.url, key, task_id, logged("text_delta"), "no text")
        turn_id = await _running_turn(sessions, task_id)
        victim = process_of(cluster, await owner_of(sessions, turn_id) or "")
        # drain 1 s < the turn's 3 s: handed back, and a clean exit
        assert cluster.kill(victim, signal.SIGTERM, grace=20) == 0
        cluster.start_worker()
        got = await live
    assert_whole(got.events)
    resumed = [e for e in got.events if e["type"] == "turn_resumed"]
    assert len(resumed) == 1 and resumed[0]["reason"] == "resumed"
    assert visible_text(got.events) == "d " * 60
    assert got.events[-1]["phase"] == "completed"


@pytest.fixture(scope="module")
def deadline_engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_url, database_url, f"{redis_prefix}deadline:", HOLDFAST_TURN_DEADLINE_SECONDS="1"
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("deadline")) as procs:
        yield procs


async def test_deadline_ends_a_hung_turn(
    deadline_engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=60) as client:
        got: Received = await execute(
            client,
            deadline_engine.url,
            key,
            {"message": script(text="s ", deltas=30, delay_ms=100)},
        )
        task_id = got.headers["x-task-id"]
        after = await execute(
            client, deadline_engine.url, key, {"message": "ok", "task_id": task_id}
        )
    assert_whole(got.events)
    assert got.events[-2]["type"] == "error" and got.events[-2]["error"] == "DEADLINE_EXCEEDED"
    assert got.events[-1]["phase"] == "errored"
    assert got.types[-3] == "usage", "an errored turn reports its usage too"
    assert got.types[-4] == "content_block_stop", "the open block was closed"
    assert after.events[-1]["phase"] == "completed"
