"""Waits on something a test can observe, bounded by the machine's time scale.

A fixed sleep ("the tool is running now") decides a scenario by a guess about
the machine: on a slow one the kill lands before the tool starts and the test
passes without testing anything. These wait for the event itself — a marker a
tool wrote, an event in the task's log, a row, a log line — and fail with
``what`` when it never comes. Every bound is multiplied by
:func:`holdfast.testing.time_scale`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import aconnect_sse

from holdfast.testing import time_scale

# How often a condition is looked at again; short next to any bound here.
_POLL_SECONDS = 0.05

Events = list[dict[str, Any]]


async def until(check: Callable[[], Awaitable[bool]], what: str, within: float = 20.0) -> None:
    """Returns once ``check()`` is true; fails naming ``what`` after ``within`` s (scaled)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within * time_scale()
    while not await check():
        if loop.time() > end:
            raise AssertionError(f"{what}: not within {within * time_scale():.0f} s")
        await asyncio.sleep(_POLL_SECONDS)


async def until_file(path: Path, what: str, within: float = 20.0) -> None:
    """Returns once ``path`` exists (a marker a tool writes)."""

    async def written() -> bool:
        return await asyncio.to_thread(path.exists)

    await until(written, what, within)


async def until_logged(
    client: httpx.AsyncClient,
    base: str,
    key: str,
    task_id: str,
    check: Callable[[Events], bool],
    what: str,
    within: float = 30.0,
) -> Events:
    """Follows the task's log (``/execute/replay`` from its start, live) until the
    events so far pass ``check``; returns them."""
    events: Events = []
    try:
        async with asyncio.timeout(within * time_scale()):
            while True:  # a task not created yet is a 404: look again
                async with aconnect_sse(
                    client,
                    "GET",
                    f"{base}/execute/replay",
                    params={"task_id": task_id, "after": 0},
                    headers={"X-Engine-Key": key},
                ) as source:
                    if source.response.status_code == 200:
                        async for sse in source.aiter_sse():
                            if sse.event == "heartbeat":
                                continue
                            events.append(json.loads(sse.data))
                            if check(events):
                                return events
                    else:
                        await source.response.aread()
                events = []
                await asyncio.sleep(_POLL_SECONDS)
    except TimeoutError:
        raise AssertionError(
            f"{what}: not within {within * time_scale():.0f} s; logged {types(events)}"
        ) from None


def types(events: Events) -> list[str]:
    return [e["type"] for e in events]


def logged(kind: str) -> Callable[[Events], bool]:
    """A check for :func:`until_logged`: an event of type ``kind`` is in the log."""
    return lambda events: any(e["type"] == kind for e in events)


def logged_after(first: str, then: str) -> Callable[[Events], bool]:
    """A check: an event of type ``then`` comes after one of type ``first``."""

    def check(events: Events) -> bool:
        seen = types(events)
        return first in seen and then in seen[seen.index(first) + 1 :]

    return check


async def until_log_line(log: Path, line: str, what: str, within: float = 30.0) -> None:
    """Returns once a process's log file holds ``line``."""

    async def written() -> bool:
        text = await asyncio.to_thread(log.read_text, errors="replace")
        return line in text

    await until(written, what, within)
