"""``/v1/execution``: create, checkpoints, pause, resume with rollback (conversation,
state and files), delete while running, automatic checkpoints, max duration,
retries, every error code, and workers SIGKILLed while pausing and resuming —
real processes, the scripted model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Execution, ExecutionCheckpoint, Message, Task, Turn
from holdfast_shared.keys import Keys
from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing import Process
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import replay
from tests.taskids import TENANTS
from tests.waiting import logged, until_logged

# Generous: the first test also pays for starting the module's engine on a busy machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """One gateway, two loop-workers and a tool-runner, with a 2 s lease (so a
    killed worker's turn is taken over quickly)."""
    workspaces = tmp_path_factory.mktemp("execution-workspaces")
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}executions:",
        HOLDFAST_LEASE_SECONDS="2",
        HOLDFAST_WORKSPACE_ROOT=str(workspaces),
        HOLDFAST_TOOL_PERMISSIONS=json.dumps({"*": {"bash": "allow"}}),
    )
    with running_engine(
        env, workers=2, runners=1, directory=tmp_path_factory.mktemp("executions")
    ) as procs:
        procs.workspaces = workspaces  # type: ignore[attr-defined]
        yield procs


class Api:
    def __init__(self, client: httpx.AsyncClient, base: str, key: str) -> None:
        self.client = client
        self.base = base
        self.key = key

    async def call(self, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return await self.client.request(
            method, f"{self.base}{path}", json=body, headers={"X-Engine-Key": self.key}, **kw
        )

    async def create(self, **body: Any) -> dict[str, Any]:
        body.setdefault("name", "test execution")
        reply = await self.call("POST", "/v1/execution", body)
        assert reply.status_code == 201, reply.text
        created: dict[str, Any] = reply.json()
        return created

    async def get(self, execution_id: str) -> dict[str, Any]:
        reply = await self.call("GET", f"/v1/execution/{execution_id}")
        assert reply.status_code == 200, reply.text
        found: dict[str, Any] = reply.json()
        return found

    async def wait(self, execution_id: str, status: str, within: float = 30) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        until = loop.time() + within
        while True:
            found = await self.get(execution_id)
            if found["status"] == status:
                return found
            assert loop.time() < until, f"still {found['status']}, not {status}: {found}"
            await asyncio.sleep(0.05)


@pytest.fixture
async def api(cluster: EngineProcesses, api_keys: dict[str, str]) -> AsyncIterator[Api]:
    async with httpx.AsyncClient(timeout=60) as client:
        yield Api(client, cluster.url, api_keys["main"])


def script(**kw: Any) -> str:
    return "/script " + json.dumps(kw)


def bash(command: str, **kw: Any) -> str:
    return script(tool_calls=[{"name": "bash", "input": {"command": command}}], **kw)


async def row_of(sessions: async_sessionmaker[AsyncSession], execution_id: str) -> Execution:
    async with sessions() as session:
        row = await session.get(Execution, execution_id)
    assert row is not None
    return row


async def current_messages(sessions: Any, task_id: str) -> list[Message]:
    async with sessions() as session:
        rows = await session.scalars(
            select(Message)
            .where(Message.task_id == task_id, Message.taken_off_by.is_(None))
            .order_by(Message.id)
        )
        return list(rows)


async def until(predicate: Any, within: float = 20) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not await predicate():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.05)


def workspace(cluster: EngineProcesses, row: Execution) -> Path:
    root: Path = cluster.workspaces  # type: ignore[attr-defined]
    return root / TENANTS["main"] / row.task_id


async def owner_process(cluster: EngineProcesses, sessions: Any, turn_id: str) -> Process:
    """The worker process holding the turn's lease (once one does)."""
    owner: str | None = None

    async def held() -> bool:
        nonlocal owner
        async with sessions() as session:
            owner = await session.scalar(select(Turn.lease_owner).where(Turn.id == turn_id))
        return owner is not None

    # Generous: the worker that takes it may be one still starting on a loaded machine.
    await until(held, within=60)
    assert owner is not None
    pid = int(owner.rsplit("-", 1)[1])
    return next(p for p in cluster.workers if p.pid == pid)


async def streaming(cluster: EngineProcesses, api: Api, sessions: Any, execution_id: str) -> None:
    """Returns once a worker holds the execution's turn and its model call streams,
    so what races it meets a turn under way, not one still being set up."""
    row = await row_of(sessions, execution_id)
    await owner_process(cluster, sessions, row.turn_id or "")
    await until_logged(
        api.client, api.base, api.key, execution_id, logged("text_delta"), "no text streamed"
    )


async def test_rollback_brings_back_conversation_state_and_files(
    cluster: EngineProcesses, api: Api, sessions: Any
) -> None:
    # A model call that streams ~1.5 s, then a tool that changes a file and works on.
    message = bash("echo changed > out.txt; sleep 3", text="thinking ", deltas=30, delay_ms=50)
    created = await api.create(input=message, state={"stage": 1}, description="rollback")
    assert created["id"].startswith("exec_") and created["status"] == "running"
    assert created["state"] == {"stage": 1} and created["completed_at"] is None
    execution_id = created["id"]
    first = await api.call("PUT", f"/v1/execution/{execution_id}/checkpoint", {"label": "start"})
    assert first.status_code == 201, first.text
    start = first.json()
    assert start["label"] == "start" and start["state"] == {"stage": 1}
    row = await row_of(sessions, execution_id)
    out = workspace(cluster, row) / "out.txt"

    async def changed() -> bool:
        return out.exists()

    await until(changed)  # the tool ran: the files changed
    paused = await api.call("POST", f"/v1/execution/{execution_id}/pause")
    assert paused.status_code == 202, paused.text
    got = await api.wait(execution_id, "paused")
    async with sessions() as session:
        turn = await session.get(Turn, row.turn_id)
    assert turn is not None and turn.status == "paused" and turn.lease_owner is None
    assert (await row_of(sessions, execution_id)).paused_at is not None
    # A checkpoint while paused, replacing the state.
    later = await api.call(
        "PUT", f"/v1/execution/{execution_id}/checkpoint", {"label": "later", "state": {"stage": 2}}
    )
    assert later.status_code == 201
    got = await api.get(execution_id)
    assert got["state"] == {"stage": 2}
    assert [c["label"] for c in got["checkpoints"]] == ["start", "later"]
    assert len(await current_messages(sessions, row.task_id)) >= 3  # user, tool use, results

    resumed = await api.call(
        "POST", f"/v1/execution/{execution_id}/resume", {"checkpoint_id": start["id"]}
    )
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "running"
    # Back to the first checkpoint (the model's call streams for a while first).
    assert resumed.json()["state"] == {"stage": 1}
    assert not out.exists(), "the workspace is back to its checkpoint"
    messages = await current_messages(sessions, row.task_id)
    assert [m.role for m in messages] == ["user"]

    done = await api.wait(execution_id, "completed")
    assert done["completed_at"] is not None and done["failure_reason"] is None
    assert out.read_text() == "changed\n", "the tool ran again against the restored files"
    async with httpx.AsyncClient(timeout=30) as client:
        log = await replay(client, cluster.url, api.key, {"task_id": execution_id})
    reasons = [e["reason"] for e in log.events if e["type"] == "turn_resumed"]
    assert "rollback" in reasons
    # The rolled-back messages stay readable, off the current branch.
    async with sessions() as session:
        taken = await session.scalars(
            select(Message.id).where(
                Message.task_id == row.task_id, Message.taken_off_by.is_not(None)
            )
        )
        assert len(list(taken)) >= 2


async def test_resume_without_checkpoint_goes_on_from_the_pause(api: Api, sessions: Any) -> None:
    created = await api.create(input=bash("sleep 1; echo done", text="x ", deltas=10))
    execution_id = created["id"]
    assert (await api.call("POST", f"/v1/execution/{execution_id}/pause")).status_code == 202
    await api.wait(execution_id, "paused")
    paused = await api.get(execution_id)
    await asyncio.sleep(1.2)  # paused time is not active time
    assert (await api.get(execution_id))["elapsed_seconds"] == paused["elapsed_seconds"]
    resumed = await api.call("POST", f"/v1/execution/{execution_id}/resume", {})
    assert resumed.status_code == 200
    await api.wait(execution_id, "completed")
    row = await row_of(sessions, execution_id)
    assert row.active_ms < 10_000


async def test_a_pause_reaps_what_the_tasks_tools_left_running(
    api: Api, sessions: Any, redis: Redis, redis_prefix: str
) -> None:
    """Security issue #23: a stdio MCP server outlived the pause and changed the
    workspace while a checkpoint archived it. Parking on a pause sends the
    tool-runners the turn-end reap (which closes the task's stdio sessions and kills
    its processes), before the turn ends."""
    async with redis.pubsub() as pubsub:
        await pubsub.subscribe(Keys(f"{redis_prefix}executions:").tools_reap)
        created = await api.create(input=bash("sleep 1; echo done", text="x ", deltas=10))
        execution_id = created["id"]
        assert (await api.call("POST", f"/v1/execution/{execution_id}/pause")).status_code == 202
        row = await row_of(sessions, execution_id)
        reaped: list[str] = []

        async def reap_sent() -> bool:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)
            if message is not None:
                reaped.append(str(message["data"]))
            return f"{TENANTS['main']} {row.task_id}" in reaped

        await until(reap_sent)
        assert (await api.get(execution_id))["status"] == "paused", "sent by the pause"
    resumed = await api.call("POST", f"/v1/execution/{execution_id}/resume", {})
    assert resumed.status_code == 200
    await api.wait(execution_id, "completed")


async def test_delete_while_running_terminates_first(
    cluster: EngineProcesses, api: Api, sessions: Any
) -> None:
    created = await api.create(input=script(text="word ", deltas=400, delay_ms=50))
    execution_id = created["id"]
    row = await row_of(sessions, execution_id)
    await owner_process(cluster, sessions, row.turn_id or "")
    loop = asyncio.get_running_loop()
    started = loop.time()
    deleted = await api.call("DELETE", f"/v1/execution/{execution_id}")
    assert deleted.status_code == 204, deleted.text
    assert loop.time() - started < 10, "the turn was cancelled, not waited out"
    gone = await api.call("GET", f"/v1/execution/{execution_id}")
    assert gone.status_code == 404 and gone.json()["error"] == "EXECUTION_NOT_FOUND"
    async with sessions() as session:
        assert await session.get(Turn, row.turn_id) is None
    task = await api.call("DELETE", f"/tasks/{execution_id}")
    assert task.status_code == 404, "the task went with it"


async def test_delete_a_paused_execution(api: Api) -> None:
    created = await api.create(input=script(text="word ", deltas=20, delay_ms=20))
    execution_id = created["id"]
    await api.call("POST", f"/v1/execution/{execution_id}/pause")
    await api.wait(execution_id, "paused")
    assert (await api.call("DELETE", f"/v1/execution/{execution_id}")).status_code == 204
    assert (await api.call("GET", f"/v1/execution/{execution_id}")).status_code == 404


async def test_delete_racing_a_pause(cluster: EngineProcesses, api: Api, sessions: Any) -> None:
    """The pause parks the turn while the delete waits for it to stop: the parked
    turn is no worker's any more, so the delete ends it itself, at once."""
    loop = asyncio.get_running_loop()
    for _ in range(3):
        created = await api.create(input=script(text="word ", deltas=400, delay_ms=20))
        execution_id = created["id"]
        await streaming(cluster, api, sessions, execution_id)
        started = loop.time()
        paused, deleted = await asyncio.gather(
            api.call("POST", f"/v1/execution/{execution_id}/pause"),
            api.call("DELETE", f"/v1/execution/{execution_id}"),
        )
        started = loop.time()
        assert deleted.status_code == 204, deleted.text
        assert loop.time() - started < 5
        assert paused.status_code in (202, 404, 409), paused.text
        assert (await api.call("GET", f"/v1/execution/{execution_id}")).status_code == 404


async def test_cancel_a_paused_execution(api: Api) -> None:
    """No worker holds a paused turn: the cancel makes it claimable, and the
    worker that takes it ends it with its events, as any cancelled turn."""
    created = await api.create(input=script(text="word ", deltas=200, delay_ms=20))
    execution_id = created["id"]
    assert (await api.call("POST", f"/v1/execution/{execution_id}/pause")).status_code == 202
    await api.wait(execution_id, "paused")
    cancelled = await api.call("POST", "/execute/cancel", {"task_id": execution_id})
    assert cancelled.status_code == 200, cancelled.text
    await api.wait(execution_id, "terminated", within=15)
    async with httpx.AsyncClient(timeout=30) as client:
        log = await replay(client, api.base, api.key, {"task_id": execution_id})
    last = log.events[-1]
    assert last["type"] == "thread_lifecycle" and last["stop_reason"] == "cancelled", last


async def test_cancel_racing_a_pause(cluster: EngineProcesses, api: Api, sessions: Any) -> None:
    """Sent together, the cancel may reach the worker while the turn stops for
    the pause: it is not lost, the turn ends cancelled rather than paused."""
    for _ in range(3):
        created = await api.create(input=script(text="word ", deltas=400, delay_ms=20))
        execution_id = created["id"]
        await streaming(cluster, api, sessions, execution_id)
        paused, cancelled = await asyncio.gather(
            api.call("POST", f"/v1/execution/{execution_id}/pause"),
            api.call("POST", "/execute/cancel", {"task_id": execution_id}),
        )
        assert cancelled.status_code == 200, cancelled.text
        assert paused.status_code in (202, 409), paused.text
        await api.wait(execution_id, "terminated", within=15)


async def test_automatic_checkpoints(cluster: EngineProcesses, api: Api, sessions: Any) -> None:
    message = bash("echo a > a.txt; sleep 1", text="w ", deltas=20, delay_ms=50)
    created = await api.create(
        input=message, config={"checkpoint_interval_seconds": 0.5}, state={"n": 1}
    )
    execution_id = created["id"]
    done = await api.wait(execution_id, "completed")
    automatic = [c for c in done["checkpoints"] if c["label"] == "automatic"]
    assert len(automatic) >= 2, done["checkpoints"]
    assert all(c["state"] == {"n": 1} for c in automatic)
    stamps = [c["timestamp"] for c in automatic]
    assert stamps == sorted(stamps)
    async with sessions() as session:
        rows = list(
            await session.scalars(
                select(ExecutionCheckpoint)
                .where(ExecutionCheckpoint.execution_id == execution_id)
                .order_by(ExecutionCheckpoint.created_at)
            )
        )
    assert all(r.automatic and r.turn_state is not None for r in rows)
    # The one after the tool ran archived the file it wrote.
    assert rows[-1].workspace_archive_id is not None


async def test_max_duration_fails_the_execution(api: Api) -> None:
    created = await api.create(
        input=script(text="slow ", deltas=100, delay_ms=50),
        config={"max_duration_seconds": 1, "retry": {"max_attempts": 3, "backoff_seconds": 0}},
    )
    failed = await api.wait(created["id"], "failed")
    assert failed["failure_reason"].startswith("EXECUTION_MAX_DURATION")
    assert "max_duration_seconds" in failed["failure_reason"]
    assert failed["attempts"] == 0, "a deadline is not retried"
    assert 1 <= failed["elapsed_seconds"] < 5
    assert failed["completed_at"] is not None


async def test_failed_steps_are_retried_from_the_last_checkpoint(
    cluster: EngineProcesses, api: Api
) -> None:
    created = await api.create(
        input=script(text="almost ", deltas=3, fail="the model broke"),
        config={"retry": {"max_attempts": 2, "backoff_seconds": 0.2}},
    )
    execution_id = created["id"]
    failed = await api.wait(execution_id, "failed")
    assert failed["attempts"] == 2
    assert "the model broke" in failed["failure_reason"]
    async with httpx.AsyncClient(timeout=30) as client:
        log = await replay(client, cluster.url, api.key, {"task_id": execution_id, "after_seq": 0})
    rollbacks = [e for e in log.events if e["type"] == "turn_resumed" and e["reason"] == "rollback"]
    assert len(rollbacks) == 2
    errors = [e for e in log.events if e["type"] == "error"]
    assert len(errors) == 3, "the first run and two retries"


async def test_error_codes(api: Api, api_keys: dict[str, str], cluster: EngineProcesses) -> None:
    async def expect(reply: httpx.Response, status: int, code: str) -> dict[str, Any]:
        assert reply.status_code == status, reply.text
        body: dict[str, Any] = reply.json()
        assert body["error"] == code, body
        return body

    missing = "exec_missing"
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", f"/v1/execution/{missing}", None),
        ("POST", f"/v1/execution/{missing}/pause", None),
        ("POST", f"/v1/execution/{missing}/resume", {}),
        ("PUT", f"/v1/execution/{missing}/checkpoint", {}),
        ("DELETE", f"/v1/execution/{missing}", None),
    ]
    for method, path, body in calls:
        await expect(await api.call(method, path, body), 404, "EXECUTION_NOT_FOUND")

    created = await api.create(input="hello")
    execution_id = created["id"]
    # Another tenant's execution is not found either.
    async with httpx.AsyncClient(timeout=30) as client:
        other = Api(client, cluster.url, api_keys["other"])
        await expect(
            await other.call("GET", f"/v1/execution/{execution_id}"), 404, "EXECUTION_NOT_FOUND"
        )
        await expect(
            await other.call("DELETE", f"/v1/execution/{execution_id}"), 404, "EXECUTION_NOT_FOUND"
        )
        listed = await other.call("GET", "/v1/execution")
        assert execution_id not in [e["id"] for e in listed.json()["executions"]]
    await api.wait(execution_id, "completed")
    await expect(
        await api.call("POST", f"/v1/execution/{execution_id}/pause"), 409, "EXECUTION_NOT_RUNNING"
    )
    await expect(
        await api.call("POST", f"/v1/execution/{execution_id}/resume"), 409, "EXECUTION_NOT_PAUSED"
    )

    running = await api.create(input=script(text="w ", deltas=100, delay_ms=50))
    await expect(
        await api.call("POST", f"/v1/execution/{running['id']}/resume", {}),
        409,
        "EXECUTION_NOT_PAUSED",
    )
    assert (await api.call("POST", f"/v1/execution/{running['id']}/pause")).status_code == 202
    await api.wait(running["id"], "paused")
    await expect(
        await api.call("POST", f"/v1/execution/{running['id']}/pause"),
        409,
        "EXECUTION_NOT_RUNNING",
    )
    await expect(
        await api.call(
            "POST", f"/v1/execution/{running['id']}/resume", {"checkpoint_id": "ckpt_nope"}
        ),
        404,
        "CHECKPOINT_NOT_FOUND",
    )
    assert (await api.get(running["id"]))["status"] == "paused", "a refused resume changes nothing"
    assert (await api.call("DELETE", f"/v1/execution/{running['id']}")).status_code == 204

    before = (await api.call("GET", "/v1/execution", params={"limit": 100})).json()
    await expect(
        await api.call("POST", "/v1/execution", {"name": "x", "input": "hi", "agent_id": "nobody"}),
        404,
        "AGENT_NOT_FOUND",
    )
    after = (await api.call("GET", "/v1/execution", params={"limit": 100})).json()
    assert len(after["executions"]) == len(before["executions"]), "nothing was written"

    def named(body: dict[str, Any], field: str) -> None:
        assert any(field in e["loc"] for e in body["details"]["errors"]), body

    for bad, field in [
        ({"name": "x", "input": "hi", "surprise": 1}, "surprise"),
        ({"name": "x"}, "input"),
        ({"name": "", "input": "hi"}, "name"),
        (
            {"name": "x", "input": "hi", "config": {"checkpoint_interval_seconds": -1}},
            "checkpoint_interval_seconds",
        ),
        (
            {"name": "x", "input": "hi", "config": {"max_duration_seconds": 0}},
            "max_duration_seconds",
        ),
        ({"name": "x", "input": "hi", "config": {"retry": {"max_attempts": -1}}}, "max_attempts"),
        (
            {
                "name": "x",
                "input": "hi",
                "config": {"retry": {"max_attempts": 1, "backoff_seconds": -2}},
            },
            "backoff_seconds",
        ),
        ({"name": "x", "input": "hi", "state": [1]}, "state"),
    ]:
        named(
            await expect(await api.call("POST", "/v1/execution", bad), 422, "INVALID_REQUEST"),
            field,
        )
    named(
        await expect(
            await api.call("PUT", f"/v1/execution/{execution_id}/checkpoint", {"labl": "x"}),
            422,
            "INVALID_REQUEST",
        ),
        "labl",
    )
    named(
        await expect(
            await api.call("GET", "/v1/execution", params={"status": "asleep"}),
            422,
            "INVALID_REQUEST",
        ),
        "status",
    )
    named(
        await expect(
            await api.call("GET", "/v1/execution", params={"cursor": "garbage"}),
            422,
            "INVALID_REQUEST",
        ),
        "cursor",
    )


async def test_list_is_paginated_and_filtered(api: Api) -> None:
    made = [(await api.create(input="hello", task_type="listing"))["id"] for _ in range(3)]
    for execution_id in made:
        await api.wait(execution_id, "completed")
    seen: list[str] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"limit": 2, "status": "completed"}
        if cursor:
            params["cursor"] = cursor
        page = (await api.call("GET", "/v1/execution", params=params)).json()
        assert len(page["executions"]) <= 2
        assert all(e["status"] == "completed" for e in page["executions"])
        seen += [e["id"] for e in page["executions"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen))
    assert [i for i in seen if i in made] == sorted(made, reverse=True), "newest first"
    by_offset = (await api.call("GET", "/v1/execution", params={"limit": 1, "offset": 1})).json()
    assert len(by_offset["executions"]) == 1
    paused = (await api.call("GET", "/v1/execution", params={"status": "paused"})).json()
    assert all(e["status"] == "paused" for e in paused["executions"])


async def test_worker_killed_while_pausing(
    cluster: EngineProcesses, api: Api, sessions: Any
) -> None:
    created = await api.create(input=bash("sleep 1; echo ok", text="w ", deltas=40, delay_ms=50))
    execution_id = created["id"]
    row = await row_of(sessions, execution_id)
    victim = await owner_process(cluster, sessions, row.turn_id or "")
    assert (await api.call("POST", f"/v1/execution/{execution_id}/pause")).status_code == 202
    cluster.kill(victim)  # before the turn reached its boundary
    # The other worker carries on; the replacement is for the tests after this one.
    replacement = cluster.start("loop-worker", wait=False)
    await api.wait(execution_id, "paused", within=40)
    assert (await api.call("POST", f"/v1/execution/{execution_id}/resume", {})).status_code == 200
    done = await api.wait(execution_id, "completed", within=40)
    assert done["failure_reason"] is None
    await asyncio.to_thread(cluster.wait_ready, replacement)


async def test_worker_killed_while_resuming(
    cluster: EngineProcesses, api: Api, sessions: Any
) -> None:
    # Paused once the answer streams, and long enough that its rerun is still
    # under way when the owner is looked up: a pause that landed after the
    # whole answer (a loaded machine, CI) left a resume that ended at once.
    created = await api.create(input=script(text="w ", deltas=200, delay_ms=40))
    execution_id = created["id"]
    row = await row_of(sessions, execution_id)
    async with httpx.AsyncClient(timeout=30) as client:
        await replay(client, cluster.url, api.key, {"task_id": execution_id}, limit=4)
    assert (await api.call("POST", f"/v1/execution/{execution_id}/pause")).status_code == 202
    await api.wait(execution_id, "paused")
    assert (await api.call("POST", f"/v1/execution/{execution_id}/resume", {})).status_code == 200
    victim = await owner_process(cluster, sessions, row.turn_id or "")
    cluster.kill(victim)
    # The other worker carries on; the replacement is for the tests after this one.
    replacement = cluster.start("loop-worker", wait=False)
    done = await api.wait(execution_id, "completed", within=60)
    async with httpx.AsyncClient(timeout=30) as client:
        log = await replay(client, cluster.url, api.key, {"task_id": execution_id, "after_seq": 0})
    # Whether the survivor takes the dead worker's job ("worker_lost") or its own
    # resume job ("resumed") first is a race; either way the turn goes on whole.
    resumes = [e for e in log.events if e["type"] == "turn_resumed"]
    assert resumes
    dropped = {
        seq
        for e in resumes
        if e.get("discard_from_seq") is not None
        for seq in range(e["discard_from_seq"], e["discard_to_seq"] + 1)
    }
    text = "".join(
        e["text"] for e in log.events if e["type"] == "text_delta" and e["seq"] not in dropped
    )
    assert text == "w " * 200
    assert done["status"] == "completed"
    await asyncio.to_thread(cluster.wait_ready, replacement)


async def test_pause_cuts_a_streaming_model_call_short(cluster: EngineProcesses, api: Api) -> None:
    created = await api.create(input=script(text="word ", deltas=100, delay_ms=50))
    execution_id = created["id"]
    async with httpx.AsyncClient(timeout=30) as client:
        # Some of the ~5 s answer is out.
        await replay(client, cluster.url, api.key, {"task_id": execution_id}, limit=4)
    loop = asyncio.get_running_loop()
    asked = loop.time()
    assert (await api.call("POST", f"/v1/execution/{execution_id}/pause")).status_code == 202
    await api.wait(execution_id, "paused")
    assert loop.time() - asked < 3, "the model call was cut, not waited out"
    assert (await api.call("POST", f"/v1/execution/{execution_id}/resume")).status_code == 200
    await api.wait(execution_id, "completed", within=40)
    async with httpx.AsyncClient(timeout=30) as client:
        log = await replay(client, cluster.url, api.key, {"task_id": execution_id, "after_seq": 0})
    resumed = [e for e in log.events if e["type"] == "turn_resumed"]
    assert len(resumed) == 1 and resumed[0]["discard_from_seq"] is not None
    dropped = set(range(resumed[0]["discard_from_seq"], resumed[0]["discard_to_seq"] + 1))
    text = "".join(
        e["text"] for e in log.events if e["type"] == "text_delta" and e["seq"] not in dropped
    )
    assert text == "word " * 100, "the cut call ran again whole"


async def test_a_pause_reaches_its_subagents_and_a_resume_takes_them_on(
    api: Api, sessions: Any
) -> None:
    """#27: a pause of an execution waiting for a subagent pauses the child's turn
    too (it has no execution of its own), and the resume goes on with both: the
    child's answer whole, each of its events once in the parent's stream."""
    words = 120
    brief = script(text="w ", deltas=words, delay_ms=40)
    delegate = {"name": "delegate", "input": {"agent": "researcher", "brief": brief}}
    created = await api.create(input=script(tool_calls=[delegate]))
    execution_id = created["id"]
    seen = await until_logged(
        api.client,
        api.base,
        api.key,
        execution_id,
        lambda events: any(e["type"] == "text_delta" and e.get("subagent") for e in events),
        "no child text in the parent's stream",
    )
    child = next(e for e in seen if e["type"] == "subagent_started")["subagent"]["task_id"]
    assert (await api.call("POST", f"/v1/execution/{execution_id}/pause")).status_code == 202
    await api.wait(execution_id, "paused")

    async def child_paused() -> bool:
        async with sessions() as session:
            status = await session.scalar(
                select(Turn.status).join(Task, Task.id == Turn.task_id).where(Task.name == child)
            )
        return status == "paused"

    await until(child_paused)
    resumed = await api.call("POST", f"/v1/execution/{execution_id}/resume", {})
    assert resumed.status_code == 200, resumed.text
    await api.wait(execution_id, "completed", within=60)
    got = await replay(api.client, api.base, api.key, {"task_id": execution_id, "after": 0})
    mirrored = [e for e in got.events if e.get("subagent")]
    child_seqs = [e["subagent"]["seq"] for e in mirrored if "seq" in e["subagent"]]
    assert len(child_seqs) == len(set(child_seqs)), "each child event once"
    # A child's model call the pause cut off ran again on resume: its
    # turn_resumed (mirrored too) names the partial output to drop, by child seq.
    dropped = {
        seq
        for e in mirrored
        if e["type"] == "turn_resumed" and e.get("discard_from_seq")
        for seq in range(e["discard_from_seq"], e["discard_to_seq"] + 1)
    }
    texts = [
        e["text"]
        for e in mirrored
        if e["type"] == "text_delta" and e["subagent"]["seq"] not in dropped
    ]
    assert texts == ["w "] * words
    result = next(e for e in got.events if e["type"] == "tool_result" and not e.get("subagent"))
    assert result["output"] == "w " * words
