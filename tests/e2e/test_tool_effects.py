"""Tool effects across a process killed mid-call (#26): the crash-matrix cells of
"runner killed mid-run" and "loop-worker killed mid-run", per effect class, with
real processes and SIGKILL.

The tool is a bash command that appends the call's ``HOLDFAST_IDEMPOTENCY_KEY`` to
``effects.log`` (one line per execution: the effect counter) and then sleeps, so the
runner is killed while it runs. A read-only or idempotent call (the agent classes its
commands by pattern) is run again with the same key and the model sees one result; an
effectful one is never run again unasked: ``tool_outcome_unknown`` and a
``hitl_request`` of kind ``outcome_unknown`` come out, and each of the three answers
settles it with one result.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from holdfast_shared.jobs import idempotency_key

from holdfast.testing import scaled
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import Received, execute
from tests.taskids import TENANTS, engine_task_id, workspace_of
from tests.waiting import logged, until_file, until_logged

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

AGENT = "effects"
HITL_TTL_SECONDS = int(scaled(10))
# Appends the key (the effect, counted), then runs long enough to be killed mid-run.
COMMAND = 'echo "$HOLDFAST_IDEMPOTENCY_KEY" >> effects.log; sleep 4; echo done'


@pytest.fixture(scope="module")
def cluster(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """A gateway, a loop-worker and a tool-runner (replaced when a test kills it)."""
    workspaces = tmp_path_factory.mktemp("effects-workspaces")
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}effects:",
        HOLDFAST_LEASE_SECONDS="2",
        HOLDFAST_TOOL_CLAIM_IDLE_SECONDS="3",
        HOLDFAST_WORKSPACE_ROOT=str(workspaces),
        HOLDFAST_TOOL_PERMISSIONS=json.dumps({"*": {"bash": "allow"}}),
        # Short enough for the expiry cell to wait out; the other cells answer at once.
        HOLDFAST_CHANNEL_STATE_TTL_HITL=str(HITL_TTL_SECONDS),
    )
    with running_engine(
        env, workers=1, runners=1, directory=tmp_path_factory.mktemp("effects")
    ) as procs:
        procs.workspaces = workspaces  # type: ignore[attr-defined]
        yield procs


@pytest.fixture(scope="module")
def agent(cluster: EngineProcesses, api_keys: dict[str, str]) -> str:
    """An agent whose bash commands ending in ``# read-only`` / ``# idempotent`` are so."""
    response = httpx.post(
        f"{cluster.url}/agents",
        json={
            "name": AGENT,
            "description": "classes its bash commands by a trailing comment",
            "system_prompt": "You run commands.",
            "tools": ["bash"],
            "effects": {"bash:*# read-only": "read_only", "bash:*# idempotent": "idempotent"},
        },
        headers={"X-Engine-Key": api_keys["main"]},
    )
    assert response.status_code == 201, response.text
    shown = httpx.get(f"{cluster.url}/agents/{AGENT}", headers={"X-Engine-Key": api_keys["main"]})
    assert shown.json()["effects"]["bash"] == "effectful"
    assert shown.json()["effects"]["bash:*# idempotent"] == "idempotent"
    return AGENT


def script(command: str) -> str:
    return "/script " + json.dumps(
        {"tool_calls": [{"name": "bash", "input": {"command": command}}]}
    )


async def _run_and_kill_the_runner(
    client: httpx.AsyncClient,
    cluster: EngineProcesses,
    key: str,
    sessions: Any,
    command: str,
    *,
    until: str,
) -> tuple[str, Path, asyncio.Task[Received]]:
    """Start a turn of ``command``, SIGKILL the runner once the tool has started,
    start another, and wait for an event of type ``until``."""
    task_id = f"effects-{secrets.token_hex(3)}"
    body = {"message": script(command), "task_id": task_id, "agent": AGENT}
    live = asyncio.create_task(execute(client, cluster.url, key, body))
    workspace = await workspace_of(sessions, cluster.workspaces, task_id)  # type: ignore[attr-defined]
    await until_logged(client, cluster.url, key, task_id, logged("tool_call"), "no tool_call")
    await until_file(workspace / "effects.log", "the tool never started")
    cluster.kill(cluster.runners[0])
    assert "done" not in (workspace / "effects.log").read_text()
    cluster.start_tool_runner()
    await until_logged(client, cluster.url, key, task_id, logged(until), f"no {until}")
    return task_id, workspace, live


def _effects(workspace: Path) -> list[str]:
    return (workspace / "effects.log").read_text().splitlines()


@pytest.mark.parametrize("marker", ["# read-only", "# idempotent"])
async def test_a_safe_call_lost_mid_run_runs_again_with_the_same_key(
    cluster: EngineProcesses, agent: str, api_keys: dict[str, str], sessions: Any, marker: str
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=60) as client:
        task_id, workspace, live = await _run_and_kill_the_runner(
            client, cluster, key, sessions, f"{COMMAND} {marker}", until="tool_result"
        )
        got = await live
    effects = _effects(workspace)
    assert len(effects) == 2, "run once more after the lost attempt, and no more"
    call = next(e for e in got.events if e["type"] == "tool_call")
    task = await engine_task_id(sessions, task_id)
    expected = idempotency_key(TENANTS["main"], task, call["turn_id"], call["tool_call_id"])
    assert effects == [expected, expected], "the same key on both attempts"
    results = [e for e in got.events if e["type"] == "tool_result"]
    assert len(results) == 1 and results[0]["output"]["stdout"] == "done\n"
    assert "tool_outcome_unknown" not in got.types and "hitl_request" not in got.types
    assert got.events[-1]["phase"] == "completed"


@pytest.mark.parametrize("answer", ["retry", "succeeded", "failed"])
async def test_an_effectful_call_lost_mid_run_is_settled_by_a_person(
    cluster: EngineProcesses, agent: str, api_keys: dict[str, str], sessions: Any, answer: str
) -> None:
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(timeout=60) as client:
        task_id, workspace, live = await _run_and_kill_the_runner(
            client, cluster, key, sessions, COMMAND, until="hitl_request"
        )
        assert _effects(workspace) == _effects(workspace)[:1], "not run again unasked"
        pending = (await client.get(f"{cluster.url}/hitl/pending", headers=headers)).json()[
            "pending"
        ]
        request = next(p for p in pending if p["task_id"] == task_id)
        assert request["kind"] == "outcome_unknown"
        refused = await client.post(
            f"{cluster.url}/hitl/respond",
            json={"task_id": task_id, "request_id": request["request_id"], "answer": "yes"},
            headers=headers,
        )
        assert refused.status_code == 422 and refused.json()["error"] == "INVALID_REQUEST"
        settled = await client.post(
            f"{cluster.url}/hitl/respond",
            json={
                "task_id": task_id,
                "request_id": request["request_id"],
                "answer": answer,
                "feedback": "the payment went through",
            },
            headers=headers,
        )
        assert settled.status_code == 200, settled.text
        got = await live
    events = got.events
    unknown = [e for e in events if e["type"] == "tool_outcome_unknown"]
    assert len(unknown) == 1
    call = next(e for e in events if e["type"] == "tool_call")
    assert unknown[0]["tool_call_id"] == call["tool_call_id"]
    assert unknown[0]["sent_at"] <= unknown[0]["runner_lost_at"]
    assert [e["type"] for e in events].count("hitl_request") == 1
    effects = _effects(workspace)
    assert effects[0] == unknown[0]["idempotency_key"] == request["tool_call"]["idempotency_key"]
    results = [e for e in events if e["type"] == "tool_result"]
    assert len(results) == 1, "the model sees exactly one result"
    if answer == "retry":
        assert effects == [effects[0]] * 2, "run once more, with the same key"
        assert results[0]["output"]["stdout"] == "done\n"
    elif answer == "succeeded":
        assert len(effects) == 1
        assert results[0]["output"]["result"] == "the payment went through"
    else:
        assert len(effects) == 1
        assert "did not take effect" in results[0]["error"]
    assert events[-1]["phase"] == "completed"


@pytest.mark.parametrize("marker", ["# idempotent", ""])
async def test_a_call_whose_loop_worker_dies_mid_run_runs_once(
    cluster: EngineProcesses, agent: str, api_keys: dict[str, str], sessions: Any, marker: str
) -> None:
    """The runner finishes and stores the result; the next worker reads it back."""
    key = api_keys["main"]
    task_id = f"effects-{secrets.token_hex(3)}"
    body = {"message": script(f"{COMMAND} {marker}"), "task_id": task_id, "agent": AGENT}
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(execute(client, cluster.url, key, body))
        workspace = await workspace_of(sessions, cluster.workspaces, task_id)  # type: ignore[attr-defined]
        await until_logged(client, cluster.url, key, task_id, logged("tool_call"), "no tool_call")
        await until_file(workspace / "effects.log", "the tool never started")
        cluster.kill(cluster.workers[0])
        cluster.start_worker()
        got = await live
    assert len(_effects(workspace)) == 1, "ran once"
    results = [e for e in got.events if e["type"] == "tool_result"]
    assert len(results) == 1 and results[0]["output"]["stdout"] == "done\n"
    assert "tool_outcome_unknown" not in got.types and "turn_resumed" in got.types
    assert got.events[-1]["phase"] == "completed"


async def test_an_unsettled_unknown_outcome_expires_like_any_question(
    cluster: EngineProcesses, agent: str, api_keys: dict[str, str], sessions: Any
) -> None:
    """Nobody answers the outcome_unknown request: past the HITL TTL the call
    ends as an expired question does; the tool is never run again."""
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=60) as client:
        _task_id, workspace, live = await _run_and_kill_the_runner(
            client, cluster, key, sessions, COMMAND, until="hitl_request"
        )
        got = await asyncio.wait_for(live, HITL_TTL_SECONDS + scaled(60))
    assert [e["type"] for e in got.events].count("hitl_request") == 1
    assert [e["type"] for e in got.events].count("tool_outcome_unknown") == 1
    assert len(_effects(workspace)) == 1, "never run again unasked"
    results = [e for e in got.events if e["type"] == "tool_result"]
    assert len(results) == 1 and "expired" in (results[0].get("error") or "").lower(), results
    assert got.events[-1]["phase"] == "completed"


def _ended(events: list[dict[str, Any]]) -> bool:
    return any(
        e["type"] == "thread_lifecycle" and e["phase"] in ("completed", "errored", "cancelled")
        for e in events
    )


@pytest.mark.parametrize("marker", ["# read-only", "# idempotent", ""])
async def test_a_call_queued_while_no_runner_lives_runs_once_after_its_worker_dies(
    cluster: EngineProcesses, agent: str, api_keys: dict[str, str], sessions: Any, marker: str
) -> None:
    """The call is on the tools stream, claimed by nobody (no runner lives),
    when its loop-worker dies: the next worker and the next runner run it once."""
    key = api_keys["main"]
    task_id = f"effects-{secrets.token_hex(3)}"
    body = {"message": script(f"{COMMAND} {marker}"), "task_id": task_id, "agent": AGENT}
    cluster.kill(cluster.runners[0])
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(execute(client, cluster.url, key, body))
        workspace = await workspace_of(sessions, cluster.workspaces, task_id)  # type: ignore[attr-defined]
        await until_logged(client, cluster.url, key, task_id, logged("tool_call"), "no tool_call")
        cluster.kill(cluster.workers[0])
        cluster.start_worker()
        cluster.start_tool_runner()
        events = await until_logged(
            client, cluster.url, key, task_id, _ended, "the turn never ended", within=scaled(90)
        )
        live.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await live
    assert len(_effects(workspace)) == 1, "ran once"
    results = [e for e in events if e["type"] == "tool_result"]
    assert len(results) == 1 and results[0]["output"]["stdout"] == "done\n", results
    assert "tool_outcome_unknown" not in [e["type"] for e in events]
    assert events[-1]["phase"] == "completed"


@pytest.mark.parametrize("marker", ["# read-only", "# idempotent", ""])
async def test_a_call_runs_once_when_the_gateway_dies_mid_run(
    cluster: EngineProcesses, agent: str, api_keys: dict[str, str], sessions: Any, marker: str
) -> None:
    """The client's gateway dies while the tool runs; the client reads the turn
    from the next gateway: the call ran once, one result."""
    key = api_keys["main"]
    task_id = f"effects-{secrets.token_hex(3)}"
    body = {"message": script(f"{COMMAND} {marker}"), "task_id": task_id, "agent": AGENT}
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(execute(client, cluster.url, key, body))
        workspace = await workspace_of(sessions, cluster.workspaces, task_id)  # type: ignore[attr-defined]
        await until_logged(client, cluster.url, key, task_id, logged("tool_call"), "no tool_call")
        await until_file(workspace / "effects.log", "the tool never started")
        cluster.kill(cluster.gateways[0])
        cluster.start_gateway()
        events = await until_logged(
            client, cluster.url, key, task_id, _ended, "the turn never ended", within=scaled(90)
        )
        live.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await live
    assert len(_effects(workspace)) == 1, "ran once"
    results = [e for e in events if e["type"] == "tool_result"]
    assert len(results) == 1 and results[0]["output"]["stdout"] == "done\n", results
    assert "tool_outcome_unknown" not in [e["type"] for e in events]
    assert events[-1]["phase"] == "completed"
