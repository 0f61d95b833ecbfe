"""A reader that stops reading is dropped, not buffered for: past
HOLDFAST_SSE_MAX_BUFFERED_EVENTS the gateway ends that connection (the client resumes
from its cursor), while a normal reader of the same task gets every event (real gateway
and worker processes; the slow reader is a raw socket with a tiny receive buffer)."""

from __future__ import annotations

import asyncio
import json
import secrets
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
from tests.sse_client import execute, replay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

DELTAS = 1600
CHUNK = "y" * 3000  # ~5 MB of deltas; the sockets' buffers took ~3 MB
MAX_BUFFERED = 100


@pytest.fixture(scope="module")
def bounded(
    redis_url: str, database_url: str, redis_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcesses]:
    prefix = f"{redis_prefix}slow-{secrets.token_hex(3)}:"
    env = engine_env(
        redis_url, database_url, prefix, HOLDFAST_SSE_MAX_BUFFERED_EVENTS=str(MAX_BUFFERED)
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("slow-reader")) as procs:
        yield procs


def open_stalled_reader(base: str, key: str, task: str) -> socket.socket:
    """Ask for the task's stream and read nothing but the status line."""
    url = urlsplit(base)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting
    sock.connect((url.hostname or "127.0.0.1", url.port or 80))
    sock.sendall(
        f"GET /execute/replay?task_id={task}&after_seq=0 HTTP/1.1\r\n"
        f"Host: {url.netloc}\r\nX-Engine-Key: {key}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    assert sock.recv(12) == b"HTTP/1.1 200"
    return sock


def read_to_end(sock: socket.socket, within: float) -> bytes:
    sock.settimeout(within)
    data = bytearray()
    while chunk := sock.recv(1 << 16):
        data += chunk
    sock.close()
    return bytes(data)


def frame_ids(raw: bytes) -> tuple[list[int], list[str]]:
    """The ids and types of the whole SSE frames in a (chunked) HTTP response."""
    _head, _, body = raw.partition(b"\r\n\r\n")
    payload = bytearray()
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0 or len(rest) < size:
            break
        payload += rest[:size]
        body = rest[size + 2 :]
    ids: list[int] = []
    types: list[str] = []
    for block in payload.decode().replace("\r\n", "\n").split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        if "id" in fields:
            ids.append(int(fields["id"]))
            types.append(fields.get("event", ""))
    return ids, types


async def fanout(client: httpx.AsyncClient, base: str) -> dict[str, Any]:
    health = (await client.get(f"{base}/health", headers={"X-Engine-Key": API_KEY})).json()
    return dict(health["subsystems"]["fanout"])


async def test_a_stalled_reader_is_dropped_and_resumes_from_its_cursor(
    bounded: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key, base = api_keys["main"], bounded.url
    task = f"slow-{secrets.token_hex(4)}"
    message = "/script " + json.dumps({"text": CHUNK, "deltas": DELTAS, "delay_ms": 1})
    async with httpx.AsyncClient(timeout=90) as client:
        dropped_before = (await fanout(client, base))["slow_readers_dropped"]
        normal = asyncio.create_task(
            execute(client, base, key, {"message": message, "task_id": task})
        )
        stalled = None
        for _ in range(200):  # the task exists once its turn started
            await asyncio.sleep(0.05)
            probe = await client.get(f"{base}/tasks/{task}", headers={"X-Engine-Key": key})
            if probe.status_code == 200:
                stalled = await asyncio.to_thread(open_stalled_reader, base, key, task)
                break
        assert stalled is not None
        try:
            got = await asyncio.wait_for(normal, 90)
        except BaseException:
            stalled.close()
            raise
        # The normal reader of the same task got everything, in order.
        assert got.events[-1]["phase"] == "completed"
        assert sum(e["type"] == "text_delta" for e in got.events) == DELTAS
        assert got.seqs == list(range(1, len(got.seqs) + 1))
        # The stalled one was dropped while it still read nothing: the gateway holds
        # no subscription for it any more.
        stats = await fanout(client, base)
        deadline = time.monotonic() + 10
        while stats["subscribers"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            stats = await fanout(client, base)
        assert stats["subscribers"] == 0
        assert stats["slow_readers_dropped"] > dropped_before
        # What it does read ends early, on a whole frame; it resumes from there.
        raw = await asyncio.to_thread(read_to_end, stalled, 30)
        ids, types = frame_ids(raw)
        assert ids and ids == list(range(1, len(ids) + 1))
        last_seq = got.seqs[-1]
        assert ids[-1] < last_seq and "thread_lifecycle" not in types[1:]
        rest = await replay(
            client, base, key, {"task_id": task}, headers={"Last-Event-ID": str(ids[-1])}
        )
    assert rest.seqs == list(range(ids[-1] + 1, last_seq + 1))
    assert rest.events[-1]["phase"] == "completed"
