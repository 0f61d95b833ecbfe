"""The MCP client against the reference ``@modelcontextprotocol/server-everything``
(issue #31): a task's stdio server kept across its turns and reaped with the task,
progress notifications in the task's stream, images kept out of the text, a
failed start's stderr in the 422.

The server comes from the npm registry (``test_asset_directory``'s fixture); it
runs over stdio in the task's sandbox.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import engine_env
from tests.e2e.test_asset_directory import (  # noqa: F401 (fixtures)
    _stdio_servers,
    client,
    everything,
    make_agent,
    mcp_engine,
    register,
    result_text,
    stdio_body,
    unique,
)
from tests.e2e.test_tools_engine import by_type, tool_script
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses
from tests.sse_client import execute
from tests.waiting import until

pytestmark = pytest.mark.timeout(180)

_HIBERNATE_AFTER = 10


@pytest.fixture(scope="module")
def engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    with mcp_engine(
        engine_env(redis_url, database_url, f"{redis_prefix}mcp:"),
        everything,
        tmp_path_factory,
        "mcp",
        timeout_seconds=30,
        # Long enough for a turn to follow another, short enough to watch one hibernate.
        HOLDFAST_WORKSPACE_HIBERNATE_AFTER_SECONDS=str(_HIBERNATE_AFTER),
    ) as e:
        yield e


def _call_ms(got: Any) -> int:
    """From the call's ``tool_call`` event to its ``tool_result``."""
    (call,) = by_type(got, "tool_call")
    (result,) = by_type(got, "tool_result")
    return int(result["timestamp"]) - int(call["timestamp"])


async def test_a_second_turns_call_uses_the_kept_stdio_session_until_the_task_goes(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    """toggle-simulated-logging keeps its state in the server process: the second
    turn's call finds the first turn's toggle on, in the same process."""
    base, key = engine.url, api_keys["main"]
    name = unique("kept")
    created = await register(client, base, key, stdio_body(name, everything))
    assert created.status_code == 201, created.text
    toggle = f"{name}__toggle-simulated-logging"
    agent = await make_agent(client, base, key, [name], permissions={toggle: "allow"})
    task_id = unique("kept-task")
    before = {p.pid for p in _stdio_servers(everything)}
    body = {"message": tool_script({"name": toggle, "input": {}}), "agent": agent}

    first = await execute(client, base, key, {**body, "task_id": task_id})
    assert first.events[-1]["phase"] == "completed", first.events
    assert result_text(by_type(first, "tool_result")[0]).startswith("Started")
    servers = {p.pid for p in _stdio_servers(everything)} - before
    assert servers, "the turn's end stopped the task's stdio server"

    second = await execute(client, base, key, {**body, "task_id": task_id})
    assert second.events[-1]["phase"] == "completed", second.events
    assert result_text(by_type(second, "tool_result")[0]).startswith("Stopped")
    assert servers <= {p.pid for p in _stdio_servers(everything)}
    # No process start and handshake this time (0.8-4 s for node before).
    assert _call_ms(second) < _call_ms(first), (_call_ms(first), _call_ms(second))

    deleted = await client.delete(f"{base}/tasks/{task_id}", headers={"X-Engine-Key": key})
    assert deleted.status_code in (200, 202, 204), deleted.text

    async def gone() -> bool:
        return not servers & {p.pid for p in _stdio_servers(everything)}

    await until(gone, "the deleted task's stdio server is still running", within=60)


async def test_a_kept_server_hibernates_with_its_workspace_and_starts_again(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("sleepy")
    created = await register(client, base, key, stdio_body(name, everything))
    assert created.status_code == 201, created.text
    toggle = f"{name}__toggle-simulated-logging"
    agent = await make_agent(client, base, key, [name], permissions={toggle: "allow"})
    task_id = unique("sleepy-task")
    before = {p.pid for p in _stdio_servers(everything)}
    body = {"message": tool_script({"name": toggle, "input": {}}), "agent": agent}
    first = await execute(client, base, key, {**body, "task_id": task_id})
    assert result_text(by_type(first, "tool_result")[0]).startswith("Started")
    servers = {p.pid for p in _stdio_servers(everything)} - before
    assert servers

    async def gone() -> bool:
        return not servers & {p.pid for p in _stdio_servers(everything)}

    # Idle past HOLDFAST_WORKSPACE_HIBERNATE_AFTER_SECONDS: archived, and its server reaped.
    await until(gone, "the hibernated workspace's server is still running", within=90)
    again = await execute(client, base, key, {**body, "task_id": task_id})
    assert again.events[-1]["phase"] == "completed", again.events
    (result,) = by_type(again, "tool_result")
    assert "error" not in result, result
    assert result_text(result).startswith("Started")  # a new process, restored workspace


async def test_progress_notifications_reach_the_stream(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("progress")
    created = await register(client, base, key, stdio_body(name, everything))
    assert created.status_code == 201, created.text
    agent = await make_agent(client, base, key, [name])
    long = {
        "name": f"{name}__trigger-long-running-operation",
        "input": {"duration": 2, "steps": 4},
    }
    got = await execute(
        client,
        base,
        key,
        {"message": tool_script(long), "agent": agent, "task_id": unique("progress-task")},
    )
    assert got.events[-1]["phase"] == "completed", got.events
    (call,) = by_type(got, "tool_call")
    progress = by_type(got, "tool_progress")
    assert progress, got.types
    assert {p["tool_call_id"] for p in progress} == {call["tool_call_id"]}
    assert all(p["total"] == 4 for p in progress), progress
    assert progress[-1]["progress"] == 4  # the last report always goes
    seen = [p["progress"] for p in progress]
    assert seen == sorted(seen)
    # Between the call and its result, in order.
    order = [e["type"] for e in got.events if e["type"].startswith("tool_")]
    assert order[0] == "tool_call" and order[-1] == "tool_result", order


async def test_an_image_result_keeps_its_content_and_a_tool_error_comes_once(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    """The result as the server sent it is in the stream (the model gets the image
    as a media block: tests/loop_worker/test_mcp_tool_media.py renders that)."""
    base, key = engine.url, api_keys["main"]
    name = unique("image")
    created = await register(client, base, key, stdio_body(name, everything))
    assert created.status_code == 201, created.text
    agent = await make_agent(client, base, key, [name])
    got = await execute(
        client,
        base,
        key,
        {
            "message": tool_script({"name": f"{name}__get-tiny-image", "input": {}}),
            "agent": agent,
            "task_id": unique("image-task"),
        },
    )
    assert got.events[-1]["phase"] == "completed", got.events
    (result,) = by_type(got, "tool_result")
    images = [b for b in result["output"]["content"] if b["type"] == "image"]
    assert images and images[0]["mimeType"] == "image/png" and images[0]["data"]


async def test_a_stdio_servers_root_is_the_workspace(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    """server-everything offers get-roots-list only to a client with roots."""
    base, key = engine.url, api_keys["main"]
    name = unique("rooted")
    created = await register(client, base, key, stdio_body(name, everything))
    assert created.status_code == 201, created.text
    assert "get-roots-list" in {tool["name"] for tool in created.json()["tools"]}
    agent = await make_agent(client, base, key, [name])
    got = await execute(
        client,
        base,
        key,
        {
            "message": tool_script({"name": f"{name}__get-roots-list", "input": {}}),
            "agent": agent,
            "task_id": unique("rooted-task"),
        },
    )
    assert got.events[-1]["phase"] == "completed", got.events
    assert "file:///workspace" in result_text(by_type(got, "tool_result")[0])


async def test_a_stdio_server_that_fails_to_start_shows_its_stderr(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("broken")
    script = (
        "console.error('Error: Cannot find module holdfast-missing-dependency'); process.exit(3)"
    )
    started = time.monotonic()
    refused = await register(
        client,
        base,
        key,
        {"name": name, "transport": "stdio", "command": "node", "args": ["-e", script]},
    )
    assert refused.status_code == 422, refused.text
    details = refused.json()["details"]
    assert "Cannot find module holdfast-missing-dependency" in details["stderr"], details
    # Told at once, not after the connect timeout (30 s here).
    assert time.monotonic() - started < 25
