"""A small real SSE client over httpx + httpx-sse, for black-box tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from httpx_sse import aconnect_sse


@dataclass
class Received:
    """Events of one SSE response, in arrival order (heartbeats kept apart)."""

    status: int
    headers: httpx.Headers
    events: list[dict[str, Any]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    body: Any = None

    @property
    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    @property
    def seqs(self) -> list[int]:
        return [e["seq"] for e in self.events]

    @property
    def text(self) -> str:
        return "".join(e["text"] for e in self.events if e["type"] == "text_delta")


async def stream(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    key: str,
    limit: int | None = None,
    headers: dict[str, str] | None = None,
    **kwargs: Any,
) -> Received:
    """Read an SSE response to its end, or only ``limit`` logged events and hang up."""
    all_headers = {"X-Engine-Key": key, **(headers or {})}
    async with aconnect_sse(client, method, url, headers=all_headers, **kwargs) as source:
        response = source.response
        got = Received(response.status_code, response.headers)
        if response.status_code != 200:
            await response.aread()
            got.body = response.json()
            return got
        async for sse in source.aiter_sse():
            data = json.loads(sse.data)
            assert data["type"] == sse.event, "event: line and data type differ"
            if sse.event == "heartbeat":
                # (httpx-sse keeps the last id for frames without one, as the
                # SSE spec says; test_heartbeats checks the raw frames.)
                got.heartbeats.append(data)
                continue
            assert sse.id == str(data["seq"]), "id: line is the seq"
            got.events.append(data)
            got.ids.append(sse.id)
            if limit is not None and len(got.events) >= limit:
                break
        return got


async def execute(
    client: httpx.AsyncClient, base: str, key: str, body: dict[str, Any], **kw: Any
) -> Received:
    return await stream(client, "POST", f"{base}/execute", key=key, json=body, **kw)


async def replay(
    client: httpx.AsyncClient, base: str, key: str, params: dict[str, Any], **kw: Any
) -> Received:
    return await stream(client, "GET", f"{base}/execute/replay", key=key, params=params, **kw)


async def long_task(
    base: str, key: str, task_id: str, turns: int, *, filler: int, read_seconds: float = 60
) -> list[dict[str, Any]]:
    """Send ``turns`` messages of ``filler`` sentences each to one task, one turn
    after the other, each asserted completed; all their events, in order."""
    events: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=read_seconds) as client:
        for i in range(turns):
            message = f"message {i}: " + "the quick brown fox jumps over the lazy dog " * filler
            got = await execute(client, base, key, {"message": message, "task_id": task_id})
            assert got.events[-1]["phase"] == "completed", got.events[-4:]
            events += got.events
    return events
