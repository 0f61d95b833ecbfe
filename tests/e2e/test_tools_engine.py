"""Tool calls through the engine: permission prompts, the sandboxed runner, results in order."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Task, Turn
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import Keys
from holdfast_tool_runner.workspace_sweep import sweep_once
from holdfast_tool_runner.workspaces import Workspaces
from redis.asyncio import Redis
from sqlalchemy import delete

from tests.processes import EngineProcesses
from tests.sse_client import Received, execute, stream
from tests.taskids import TENANTS, engine_task_id, workspace_of

pytestmark = pytest.mark.timeout(90)


def tool_script(*calls: dict[str, Any], text: str = "") -> str:
    return "/script " + json.dumps({"text": text, "tool_calls": list(calls)})


async def first_pending(
    client: httpx.AsyncClient, base: str, key: str, task_id: str, *, every: float = 0.05
) -> dict[str, Any] | None:
    """Poll /hitl/pending like a client UI would (for up to ~10 s): the first request."""
    for _ in range(int(10 / every)):
        pending = (
            await client.get(
                f"{base}/hitl/pending", params={"task_id": task_id}, headers={"X-Engine-Key": key}
            )
        ).json()["pending"]
        if pending:
            return dict(pending[0])
        await asyncio.sleep(every)
    return None


async def answer_when_asked(
    client: httpx.AsyncClient, base: str, key: str, task_id: str, body: dict[str, Any]
) -> dict[str, Any]:
    """Wait for the task's request, then answer it."""
    request = await first_pending(client, base, key, task_id)
    assert request is not None, "no hitl request appeared"
    response = await client.post(
        f"{base}/hitl/respond",
        json={"task_id": task_id, "request_id": request["request_id"], **body},
        headers={"X-Engine-Key": key},
    )
    assert response.status_code == 200, response.text
    assert response.json() == {"status": "resumed", "request_id": request["request_id"]}
    return request


def by_type(got: Received, event_type: str) -> list[dict[str, Any]]:
    return [e for e in got.events if e["type"] == event_type]


async def new_workspace(
    client: httpx.AsyncClient,
    base: str,
    key: str,
    sessions: Any,
    root: Path,
    name: str,
    tenant: str = "main",
) -> Path:
    """Start the task ``name`` with a tool call, so its workspace exists; its path."""
    got = await execute(
        client,
        base,
        key,
        {"message": tool_script({"name": "list_dir", "input": {}}), "task_id": name},
    )
    assert got.events[-1]["phase"] == "completed", got.events
    return await workspace_of(sessions, root, name, tenant)


async def test_allowed_tool_runs_without_asking(
    engine: EngineProcesses, api_keys: dict[str, str], workspace_root: Path, sessions: Any
) -> None:
    task_id = f"tools-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=60) as client:
        workspace = await new_workspace(
            client, engine.url, api_keys["main"], sessions, workspace_root, task_id
        )
        (workspace / "notes.txt").write_text("remember the milk")
        got = await execute(
            client,
            engine.url,
            api_keys["main"],
            {
                "message": tool_script({"name": "read_file", "input": {"path": "notes.txt"}}),
                "task_id": task_id,
            },
        )
    assert "hitl_request" not in got.types
    call, result = by_type(got, "tool_call")[0], by_type(got, "tool_result")[0]
    assert call["tool"] == "read_file" and call["input"] == {"path": "notes.txt"}
    assert result["tool_call_id"] == call["tool_call_id"]
    assert result["output"]["content"] == "remember the milk"
    assert "error" not in result
    assert got.types.index("tool_call") < got.types.index("tool_result")
    assert "remember the milk" in got.text
    assert got.events[-1]["phase"] == "completed"


async def test_permission_prompt_yes_runs_the_tool(
    engine: EngineProcesses, api_keys: dict[str, str], workspace_root: Path, sessions: Any
) -> None:
    key = api_keys["main"]
    task_id = f"ask-{secrets.token_hex(4)}"
    message = tool_script({"name": "bash", "input": {"command": "echo hi > out.txt; cat out.txt"}})
    async with httpx.AsyncClient(timeout=60) as client:
        turn = asyncio.create_task(
            execute(client, engine.url, key, {"message": message, "task_id": task_id})
        )
        asked = await answer_when_asked(client, engine.url, key, task_id, {"answer": "yes"})
        got = await turn
        # Answered already: a second answer is a conflict.
        again = await client.post(
            f"{engine.url}/hitl/respond",
            json={"task_id": task_id, "request_id": asked["request_id"], "answer": "no"},
            headers={"X-Engine-Key": key},
        )
    assert again.status_code == 409 and again.json()["error"] == "HITL_ALREADY_ANSWERED"
    request = by_type(got, "hitl_request")[0]
    assert request["kind"] == "permission"
    assert request["tool_call"]["tool"] == "bash"
    assert request["request_id"] == asked["request_id"]
    assert by_type(got, "hitl_resolved")[0]["request_id"] == asked["request_id"]
    result = by_type(got, "tool_result")[0]
    assert result["output"]["stdout"] == "hi\n" and result["output"]["exit_code"] == 0
    order = [
        t for t in got.types if t in ("tool_call", "hitl_request", "hitl_resolved", "tool_result")
    ]
    assert order == ["tool_call", "hitl_request", "hitl_resolved", "tool_result"]
    workspace = await workspace_of(sessions, workspace_root, task_id)
    assert (workspace / "out.txt").read_text() == "hi\n"
    assert got.events[-1]["phase"] == "completed"


async def test_permission_denied_reaches_the_model_with_feedback(
    engine: EngineProcesses, api_keys: dict[str, str], workspace_root: Path, sessions: Any
) -> None:
    key = api_keys["main"]
    task_id = f"deny-{secrets.token_hex(4)}"
    message = tool_script({"name": "write_file", "input": {"path": "x.txt", "content": "x"}})
    async with httpx.AsyncClient(timeout=60) as client:
        turn = asyncio.create_task(
            execute(client, engine.url, key, {"message": message, "task_id": task_id})
        )
        await answer_when_asked(
            client, engine.url, key, task_id, {"answer": "no", "feedback": "not today"}
        )
        got = await turn
    result = by_type(got, "tool_result")[0]
    assert "denied" in result["error"] and "not today" in result["error"]
    assert "not today" in got.text  # the model saw the refusal and its feedback
    workspace = await workspace_of(sessions, workspace_root, task_id)
    assert not (workspace / "x.txt").exists()
    assert got.events[-1]["phase"] == "completed"


async def test_a_waiting_task_refuses_new_messages_and_bad_answers(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"wait-{secrets.token_hex(4)}"
    message = tool_script({"name": "bash", "input": {"command": "true"}})
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(timeout=60) as client:
        first = await stream(
            client,
            "POST",
            f"{engine.url}/execute",
            key=key,
            json={"message": message, "task_id": task_id},
            limit=6,
        )
        assert first.types[-1] == "hitl_request"
        busy = await client.post(
            f"{engine.url}/execute",
            json={"message": "hello?", "task_id": task_id},
            headers=headers,
        )
        malformed = await client.post(
            f"{engine.url}/hitl/respond",
            json={"task_id": task_id, "answer": "maybe"},
            headers=headers,
        )
        nothing = await client.post(
            f"{engine.url}/hitl/respond",
            json={"task_id": "no-such-task", "answer": "yes"},
            headers=headers,
        )
        missing_answer = await client.post(
            f"{engine.url}/hitl/respond", json={"task_id": task_id}, headers=headers
        )
        other_tenant = await client.get(
            f"{engine.url}/hitl/pending", headers={"X-Engine-Key": api_keys["other"]}
        )
        ok = await client.post(
            f"{engine.url}/hitl/respond",
            json={"task_id": task_id, "answer": "yes"},
            headers=headers,
        )
    assert busy.status_code == 409 and busy.json()["error"] == "HITL_REQUIRED"
    assert malformed.status_code == 422
    assert nothing.status_code == 404 and nothing.json()["error"] == "HITL_NOT_FOUND"
    assert missing_answer.status_code == 422
    assert all(p["task_id"] != task_id for p in other_tenant.json()["pending"])
    assert ok.status_code == 200


async def test_tool_failure_is_a_result_not_a_crash(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(
            client,
            engine.url,
            api_keys["main"],
            {
                "message": tool_script(
                    {"name": "read_file", "input": {"path": "missing.txt"}},
                    {"name": "list_dir", "input": {}},
                )
            },
        )
    results = by_type(got, "tool_result")
    assert len(results) == 2
    assert "FileNotFoundError" in results[0]["error"]
    assert results[1]["output"]["entries"] == []
    calls = [e["tool_call_id"] for e in by_type(got, "tool_call")]
    assert [r["tool_call_id"] for r in results] == calls
    assert got.events[-1]["phase"] == "completed"


async def test_workspaces_are_per_task_and_go_with_the_task(
    engine: EngineProcesses, api_keys: dict[str, str], workspace_root: Path, sessions: Any
) -> None:
    key = api_keys["main"]
    mine, other = f"ws-a-{secrets.token_hex(3)}", f"ws-b-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        workspace = await new_workspace(client, engine.url, key, sessions, workspace_root, mine)
        (workspace / "kept.txt").write_text("turn one")
        first = await execute(
            client,
            engine.url,
            key,
            {"message": tool_script({"name": "list_dir", "input": {}}), "task_id": mine},
        )
        second = await execute(
            client,
            engine.url,
            key,
            {
                "message": tool_script({"name": "read_file", "input": {"path": "kept.txt"}}),
                "task_id": mine,
            },
        )
        peek = await execute(
            client,
            engine.url,
            key,
            {
                "message": tool_script(
                    {"name": "read_file", "input": {"path": f"../{workspace.name}/kept.txt"}}
                ),
                "task_id": other,
            },
        )
        refused = await client.delete(
            f"{engine.url}/tasks/{mine}", headers={"X-Engine-Key": api_keys["other"]}
        )
        deleted = await client.delete(f"{engine.url}/tasks/{mine}", headers={"X-Engine-Key": key})
        gone = await client.get(
            f"{engine.url}/execute/replay", params={"task_id": mine}, headers={"X-Engine-Key": key}
        )
    names = [e["name"] for e in by_type(first, "tool_result")[0]["output"]["entries"]]
    assert names == ["kept.txt"]
    assert by_type(second, "tool_result")[0]["output"]["content"] == "turn one"
    assert "error" in by_type(peek, "tool_result")[0]  # another task's workspace is not there
    assert refused.status_code == 404
    assert deleted.status_code == 200
    assert gone.status_code == 404
    await gone_within(workspace, seconds=10)


async def gone_within(path: Path, *, seconds: float) -> None:
    for _ in range(int(seconds / 0.05)):
        if not await asyncio.to_thread(path.exists):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{path} is still there after {seconds} s")


async def test_a_deleted_tasks_files_never_reach_the_next_task_of_that_name(
    engine: EngineProcesses, api_keys: dict[str, str], workspace_root: Path, sessions: Any
) -> None:
    # The probe's race: tenant A fills task X's workspace and deletes X; at
    # once tenant B (and A again) start a task X. Neither may see A's files,
    # and the old workspace's removal must not wipe the new ones.
    a, b = api_keys["main"], api_keys["other"]
    read_secret = tool_script(
        {"name": "read_file", "input": {"path": "secret.txt"}}, {"name": "list_dir", "input": {}}
    )
    async with httpx.AsyncClient(timeout=60) as client:
        for round_ in range(4):
            name = f"reuse-{round_}-{secrets.token_hex(3)}"
            old = await new_workspace(client, engine.url, a, sessions, workspace_root, name)
            (old / "secret.txt").write_text("tenant A's secret")
            for i in range(2000):
                (old / f"f{i:05d}").write_bytes(b"x")
            deleted = await client.delete(f"{engine.url}/tasks/{name}", headers={"X-Engine-Key": a})
            assert deleted.status_code == 200
            theirs, again = await asyncio.gather(
                execute(client, engine.url, b, {"message": read_secret, "task_id": name}),
                execute(client, engine.url, a, {"message": read_secret, "task_id": name}),
            )
            for got in (theirs, again):
                assert got.status == 200 and got.events[0]["seq"] == 1, "a new task"
                secret, listing = by_type(got, "tool_result")
                assert "error" in secret and "secret" not in json.dumps(secret.get("output"))
                assert listing["output"]["entries"] == []
            new_b = await workspace_of(sessions, workspace_root, name, "other")
            new_a = await workspace_of(sessions, workspace_root, name)
            assert len({old, new_a, new_b}) == 3
            await gone_within(old, seconds=20)
            assert new_a.is_dir() and new_b.is_dir(), "the old removal reached a new workspace"


async def test_the_model_asks_the_user_and_the_answer_is_the_result(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"question-{secrets.token_hex(3)}"
    message = tool_script({"name": "ask_user", "input": {"question": "Which colour?"}})
    async with httpx.AsyncClient(timeout=60) as client:
        turn = asyncio.create_task(
            execute(client, engine.url, key, {"message": message, "task_id": task_id})
        )
        attached = [{"type": "text", "text": "swatch #008080"}]
        asked = await answer_when_asked(
            client, engine.url, key, task_id, {"answer": "teal", "content_blocks": attached}
        )
        got = await turn
    assert asked["kind"] == "question" and asked["question"] == "Which colour?"
    request = by_type(got, "hitl_request")[0]
    assert request["kind"] == "question" and "tool_call" not in request
    assert by_type(got, "hitl_resolved")[0]["answer"] == "teal"
    assert by_type(got, "tool_result")[0]["output"] == {
        "answer": "teal",
        "content_blocks": attached,
    }
    assert "teal" in got.text
    assert got.events[-1]["phase"] == "completed"


async def test_health_lists_the_tool_runners_and_their_sandbox(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    keyed = {"X-Engine-Key": api_keys["main"]}
    async with httpx.AsyncClient(timeout=10, headers=keyed) as client:
        for _ in range(100):  # the runner announces itself once its probe has run
            runners = (
                (await client.get(f"{engine.url}/health"))
                .json()["subsystems"]
                .get("tool_runners", {})
            )
            if runners:
                break
            await asyncio.sleep(0.1)
    assert len(runners) >= 1
    for report in runners.values():
        assert report["available"] is True, report
        assert report["network"] in ("slirp4netns", "host")
        limits = report["limits"]
        assert set(limits) == {"pids", "memory", "cpu", "file_size", "kill", "disk"}
        # Each names the mechanism in force for a whole call, never "unknown".
        assert limits["memory"] in ("cgroup2", "cgroup1", "rss-budget"), limits
        assert limits["disk"] in ("loop-ext4", "tmpfs", "none"), limits
        assert report["workspaces"]["disk"] == limits["disk"]


async def test_answers_that_race_the_parking_turn_are_not_lost(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    # Answered the moment the request exists: the answer and its resume job often
    # arrive while the worker is still parking the turn (snapshot, lease release).
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    message = tool_script({"name": "ask_user", "input": {"question": "Now?"}})
    async with httpx.AsyncClient(timeout=60) as client:
        for round_ in range(12):
            task_id = f"race-{round_}-{secrets.token_hex(3)}"
            turn = asyncio.create_task(
                execute(client, engine.url, key, {"message": message, "task_id": task_id})
            )
            request = await first_pending(client, engine.url, key, task_id, every=0.002)
            assert request is not None, "no hitl request appeared"
            answered = await client.post(
                f"{engine.url}/hitl/respond",
                json={"task_id": task_id, "request_id": request["request_id"], "answer": "y"},
                headers=headers,
            )
            assert answered.status_code == 200, answered.text
            got = await asyncio.wait_for(turn, 20)
            assert got.events[-1]["phase"] == "completed", f"round {round_}"
            assert by_type(got, "tool_result")[0]["output"] == {"answer": "y"}


async def test_a_parked_turn_resumed_before_its_answer_asks_only_once(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    redis: Redis,
    sessions: Any,
    redis_prefix: str,
) -> None:
    # A resume job for a turn parked on a pending question (a requeue after a Redis
    # restart, a duplicate delivery) re-parks it; the client must not be asked twice.
    key = api_keys["main"]
    task_id = f"reask-{secrets.token_hex(3)}"
    message = tool_script({"name": "ask_user", "input": {"question": "Once?"}})
    async with httpx.AsyncClient(timeout=60) as client:
        turn = asyncio.create_task(
            execute(client, engine.url, key, {"message": message, "task_id": task_id})
        )
        request = await first_pending(client, engine.url, key, task_id, every=0.02)
        assert request is not None

        async def turn_row() -> Turn:
            async with sessions() as session:
                found = await session.get(Turn, request["turn_id"])
            assert found is not None
            return found

        for _ in range(250):
            if (row := await turn_row()).status == "parked":
                break
            await asyncio.sleep(0.02)
        assert row.status == "parked"
        engine_id = await engine_task_id(sessions, task_id)
        job = TurnJob.resuming(TENANTS["main"], engine_id, row.id)
        await redis.xadd(Keys(redis_prefix).turns, job.to_fields())
        for _ in range(250):  # resumed, found the question pending, parked again
            await asyncio.sleep(0.02)
            logged = await redis.xrange(Keys(redis_prefix).events(engine_id))
            resumed = any(fields["t"] == "turn_resumed" for _, fields in logged)
            if resumed and (await turn_row()).status == "parked":
                break
        else:
            raise AssertionError("the resume job did not run")
        await answer_when_asked(client, engine.url, key, task_id, {"answer": "once"})
        got = await asyncio.wait_for(turn, 20)
    assert got.events[-1]["phase"] == "completed"
    assert len(by_type(got, "hitl_request")) == 1
    assert by_type(got, "tool_result")[0]["output"] == {"answer": "once"}


async def test_a_workspace_whose_removal_was_lost_is_swept(
    engine: EngineProcesses, api_keys: dict[str, str], workspace_root: Path, sessions: Any
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=60) as client:
        lost = await new_workspace(
            client, engine.url, key, sessions, workspace_root, f"lost-{secrets.token_hex(3)}"
        )
        kept = await new_workspace(
            client, engine.url, key, sessions, workspace_root, f"kept-{secrets.token_hex(3)}"
        )
    # The task goes without its WorkspaceRemoval job (as if Redis had lost it).
    async with sessions.begin() as session:
        await session.execute(delete(Task).where(Task.id == lost.name))
    workspaces = await asyncio.to_thread(Workspaces, workspace_root)
    removed = await sweep_once(workspaces, sessions)
    assert (TENANTS["main"], lost.name) in removed
    assert (TENANTS["main"], kept.name) not in removed
    assert not lost.exists() and (kept / ".").is_dir()
