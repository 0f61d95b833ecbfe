"""What one SSE connection costs and how it ends (sse.py, fastlane.py), on real
gateway and worker processes: heartbeats on an idle stream, a client that leaves is let
go at its next heartbeat, a gateway told to stop ends its streams at once, HEAD opens
no stream, and a replay answered by the fast lane answers exactly as the full route."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tests.conftest import engine_env
from tests.isolation import (  # noqa: F401 (fixtures)
    API_KEY,
    own_api_keys,
    own_database_url,
)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

QUIET = "/script " + json.dumps({"text": "x", "deltas": 1, "delay_ms": 3_600_000})


@pytest.fixture(scope="module")
def engine(
    redis_url: str, database_url: str, redis_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcesses]:
    prefix = f"{redis_prefix}sseconn-{secrets.token_hex(3)}:"
    env = engine_env(redis_url, database_url, prefix, HOLDFAST_HEARTBEAT_SECONDS="0.5")
    with running_engine(env, directory=tmp_path_factory.mktemp("sse-connections")) as procs:
        yield procs


async def subscribers(client: httpx.AsyncClient, base: str) -> int:
    health = (await client.get(f"{base}/health", headers={"X-Engine-Key": API_KEY})).json()
    return int(health["subsystems"]["fanout"]["subscribers"])


async def quiet_task(client: httpx.AsyncClient, base: str, key: str) -> str:
    """A task whose turn streams nothing for an hour (cancelled by the test)."""
    task = f"quiet-{secrets.token_hex(4)}"
    got = await execute(client, base, key, {"message": QUIET, "task_id": task}, limit=1)
    assert got.events[0]["type"] == "thread_lifecycle"
    return task


async def cancel(client: httpx.AsyncClient, base: str, key: str, task: str) -> None:
    await client.post(
        f"{base}/execute/cancel", json={"task_id": task}, headers={"X-Engine-Key": key}
    )


def raw_replay(base: str, request: str) -> socket.socket:
    url = urlsplit(base)
    sock = socket.create_connection((url.hostname or "127.0.0.1", url.port or 80))
    sock.sendall(request.encode())
    return sock


def replay_request(base: str, key: str, task: str, method: str = "GET") -> str:
    return (
        f"{method} /execute/replay?task_id={task}&after_seq=0 HTTP/1.1\r\n"
        f"Host: {urlsplit(base).netloc}\r\nX-Engine-Key: {key}\r\n\r\n"
    )


def read_for(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(0.2)
    data = bytearray()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        data += chunk
    return bytes(data)


async def test_an_idle_stream_gets_heartbeats_and_a_departed_client_is_let_go(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key, base = api_keys["main"], engine.url
    async with httpx.AsyncClient(timeout=30) as client:
        # The POST's stream, which the client left after the first event, is
        # let go at its next heartbeat (0.5 s here).
        task = await quiet_task(client, base, key)
        await settle(client, base, 0)
        sock = await asyncio.to_thread(raw_replay, base, replay_request(base, key, task))
        data = await asyncio.to_thread(read_for, sock, 1.8)
        assert data.startswith(b"HTTP/1.1 200")
        assert b"text/event-stream" in data.split(b"\r\n\r\n", 1)[0]
        assert data.count(b"event: heartbeat") >= 2, data[-400:]
        assert await subscribers(client, base) == 1
        sock.close()
        await settle(client, base, 0)
        await cancel(client, base, key, task)


async def settle(client: httpx.AsyncClient, base: str, count: int) -> None:
    deadline = time.monotonic() + 5
    while (found := await subscribers(client, base)) != count:
        assert time.monotonic() < deadline, f"{found} subscribers, not {count}"
        await asyncio.sleep(0.1)


async def test_head_opens_no_stream(engine: EngineProcesses, api_keys: dict[str, str]) -> None:
    key, base = api_keys["main"], engine.url
    async with httpx.AsyncClient(timeout=30) as client:
        task = await quiet_task(client, base, key)
        reply = await client.head(
            f"{base}/execute/replay", params={"task_id": task}, headers={"X-Engine-Key": key}
        )
        await cancel(client, base, key, task)
    # The route is GET only; the answer comes at once, with what is allowed.
    assert reply.status_code == 405 and reply.headers["allow"] == "GET"


@pytest.mark.parametrize(
    ("query", "headers", "status", "code"),
    [
        ("task_id={task}", {}, 401, "INVALID_KEY"),
        ("task_id={task}", {"X-Engine-Key": "hf_not-a-key"}, 401, "INVALID_KEY"),
        ("task_id=no-such-task", {"X-Engine-Key": "{key}"}, 404, "TASK_NOT_FOUND"),
        ("task_id={task}", {"X-Engine-Key": "{other}"}, 404, "TASK_NOT_FOUND"),
        ("task_id={task}&token=abc", {}, 401, None),
        # Down the full route (the fast lane leaves them to FastAPI's validation).
        ("task_id={task}&after_seq=abc", {"X-Engine-Key": "{key}"}, 422, "INVALID_REQUEST"),
        ("task_id=bad%20id", {"X-Engine-Key": "{key}"}, 422, "INVALID_REQUEST"),
        ("task_id={task}&after_seq=1000000000000000000", {"X-Engine-Key": "{key}"}, 422, None),
        ("task_id={task}", {"X-Engine-Key": "{key}", "Last-Event-ID": "x1"}, 422, None),
    ],
)
async def test_replay_errors_are_the_routes_own(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    query: str,
    headers: dict[str, str],
    status: int,
    code: str | None,
) -> None:
    key, base = api_keys["main"], engine.url
    async with httpx.AsyncClient(timeout=30) as client:
        task = await quiet_task(client, base, key)
        names = {"task": task, "key": key, "other": api_keys["other"]}
        reply = await client.get(
            f"{base}/execute/replay?{query.format(**names)}",
            headers={k: v.format(**names) for k, v in headers.items()},
        )
        await cancel(client, base, key, task)
    assert reply.status_code == status, reply.text
    body: dict[str, Any] = reply.json()
    assert set(body) >= {"error", "message"}
    if code is not None:
        assert body["error"] == code


async def test_a_repeated_parameter_takes_the_full_route(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key, base = api_keys["main"], engine.url
    async with httpx.AsyncClient(timeout=30) as client:
        task = await quiet_task(client, base, key)
        await cancel(client, base, key, task)
        # FastAPI reads the last of repeated query values: the same answer as one.
        once = await client.get(
            f"{base}/execute/replay?task_id={task}", headers={"X-Engine-Key": key}
        )
        twice = await client.get(
            f"{base}/execute/replay?task_id=nope&task_id={task}", headers={"X-Engine-Key": key}
        )
    assert once.status_code == twice.status_code == 200
    assert once.text == twice.text and "event: thread_lifecycle" in once.text


async def test_a_stopping_gateway_ends_its_streams_at_once(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    prefix = f"{redis_prefix}sseconn-stop-{secrets.token_hex(3)}:"
    env = engine_env(redis_url, database_url, prefix)  # heartbeats 1 s apart
    key = api_keys["main"]
    with running_engine(env, directory=tmp_path_factory.mktemp("sse-stop")) as procs:
        base = procs.url
        async with httpx.AsyncClient(timeout=30) as client:
            task = await quiet_task(client, base, key)
        socks = [
            await asyncio.to_thread(raw_replay, base, replay_request(base, key, task))
            for _ in range(5)
        ]
        await asyncio.to_thread(read_for, socks[0], 0.5)
        gateway = procs.gateways[0]
        started = time.monotonic()
        status = await asyncio.to_thread(procs.kill, gateway, signal.SIGTERM, grace=10)
        took = time.monotonic() - started
        for sock in socks:
            sock.close()
    assert status in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it stopped on
    # Not held until uvicorn's graceful timeout (5 s) ran out.
    assert took < 4, f"the gateway took {took:.1f} s to stop with 5 open streams"
