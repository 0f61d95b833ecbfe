"""The tool-runner's MCP pieces without a server: which sessions a task keeps
(issue #31, 5), a tool error read once (10), a failed start's stderr tail (6)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast

import anyio
from holdfast_tool_runner.connectors.outcomes import call_outcome
from holdfast_tool_runner.connectors.sessions import SessionKey, Sessions
from holdfast_tool_runner.connectors.transports import StderrTail
from mcp import Client
from mcp_types import CallToolResult, ImageContent, TextContent


def _opener(closed: list[str], name: str) -> Any:
    @contextlib.asynccontextmanager
    async def opened() -> AsyncIterator[Client]:
        try:
            yield cast(Client, object())
        finally:
            closed.append(name)

    return opened


async def test_a_stopped_task_closes_its_stdio_sessions_and_a_deleted_one_all() -> None:
    sessions = Sessions(idle_seconds=300, local_idle_seconds=300)
    closed: list[str] = []
    stdio, http = SessionKey("t", "task", "local"), SessionKey("t", "task", "web")
    other = SessionKey("t", "other", "local")
    await sessions.client(stdio, "v1", _opener(closed, "stdio"), local=True)
    await sessions.client(http, "v1", _opener(closed, "http"))
    await sessions.client(other, "v1", _opener(closed, "other"), local=True)
    assert sessions.local("t", "task") == [stdio]

    assert await sessions.close_task("t", "task") == 1  # paused or parked
    assert closed == ["stdio"] and http in sessions and other in sessions
    assert await sessions.close_task("t", "task", only_local=False) == 1  # deleted
    assert closed == ["stdio", "http"] and other in sessions
    await sessions.aclose()


async def test_stdio_sessions_have_their_own_idle_time() -> None:
    sessions = Sessions(idle_seconds=300, local_idle_seconds=0.05)
    closed: list[str] = []
    stdio, http = SessionKey("t", "task", "local"), SessionKey("t", "task", "web")
    await sessions.client(stdio, "v1", _opener(closed, "stdio"), local=True)
    await sessions.client(http, "v1", _opener(closed, "http"))
    await asyncio.sleep(0.1)
    assert await sessions.sweep() == 1
    assert closed == ["stdio"] and http in sessions
    await sessions.aclose()


def test_a_tool_error_is_the_error_only_once() -> None:
    result = CallToolResult(content=[TextContent(type="text", text="bad input: a")], is_error=True)
    outcome = call_outcome(result)
    assert outcome.error == "bad input: a"
    assert outcome.output is None  # the text is not repeated as output


def test_a_tool_error_keeps_what_its_text_does_not_say() -> None:
    image = ImageContent(type="image", data="AAAA", mime_type="image/png")
    result = CallToolResult(
        content=[TextContent(type="text", text="failed"), image],
        structured_content={"code": 3},
        is_error=True,
    )
    outcome = call_outcome(result)
    assert outcome.error == "failed"
    assert outcome.output == {
        "content": [{"type": "image", "data": "AAAA", "mimeType": "image/png"}],
        "structuredContent": {"code": 3},
    }


async def test_the_stderr_tail_keeps_the_end() -> None:
    tail = StderrTail(limit=16)
    tail.feed(b"x" * 100)
    tail.feed(b"\nTraceback: boom")
    tail.ended.set()
    assert await tail.settled(0.1) == "Traceback: boom"
    with anyio.fail_after(1):
        assert await StderrTail().settled(0.01) == ""
