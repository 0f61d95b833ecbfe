"""Idle SSE connections held by a raw-socket client, for counts httpx holds too dearly.

httpx costs the bench tens of KB and a task per stream; 10,000 of them crowd
the machine the gateway is measured on. Here each connection is an
:class:`asyncio.Protocol` that writes one ``GET /execute/replay`` request and
then only counts what arrives: the response's status, and each heartbeat
frame's receive time and server timestamp (the same records as
``bench.scenarios.idle_connections``, which this mirrors).
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
from itertools import pairwise
from typing import cast
from urllib.parse import urlsplit

import psutil

from bench.scenarios import Idle, new_client, script
from bench.sse import StreamError, stream

_HEARTBEAT = re.compile(rb'event: ?heartbeat\r?\ndata: ?[^\r\n]*"timestamp": ?(\d+)')


class _Conn(asyncio.Protocol):
    __slots__ = ("_tail", "ended", "error", "heartbeats", "ok", "opened", "request", "server_ms")

    def __init__(self, request: bytes, opened: asyncio.Future[None]) -> None:
        self.request = request
        self.opened = opened
        self.ok = False
        self.ended = False
        self.error: BaseException | None = None
        self.heartbeats: list[float] = []
        self.server_ms: list[int] = []
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but write alike.
        cast(asyncio.WriteTransport, transport).write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.opened.done():
            if data.startswith(b"HTTP/1.1 200"):
                self.ok = True
                self.opened.set_result(None)
            else:
                self.opened.set_exception(StreamError(f"replay answered {data[:80]!r}"))
        # Only complete frames are looked at; the rest waits for the next read.
        buf = self._tail + data
        end = _frames_end(buf)
        self._tail = buf[end:]
        found = _HEARTBEAT.findall(buf, 0, end)
        if found:
            self.heartbeats.extend([now] * len(found))
            self.server_ms.extend(int(x) for x in found)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.error = exc
        if not self.opened.done():
            self.opened.set_exception(StreamError(f"connection lost while opening: {exc!r}"))


async def idle_connections_raw(
    url: str,
    key: str,
    gateway_pid: int,
    *,
    connections: int,
    tasks: int,
    hold_seconds: float,
    heartbeat_seconds: float,
    open_concurrency: int = 100,
    create_concurrency: int = 8,
) -> Idle:
    gateway = psutil.Process(gateway_pid)
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    quiet = {"message": script(text="x", deltas=1, delay_ms=3_600_000)}
    create_gate = asyncio.Semaphore(create_concurrency)
    async with new_client(timeout=max(60.0, 10 * heartbeat_seconds)) as client:

        async def create() -> str:
            async with create_gate:
                got = await stream(
                    client,
                    "POST",
                    f"{url}/execute",
                    key=key,
                    json_body=quiet,
                    stop_after_started=True,
                )
            assert got.task_id
            return got.task_id

        created_at = time.perf_counter()
        task_ids = await asyncio.gather(*(create() for _ in range(tasks)))
        create_seconds = time.perf_counter() - created_at

    def request(task_id: str) -> bytes:
        return (
            f"GET /execute/replay?task_id={task_id}&after_seq=0 HTTP/1.1\r\n"
            f"Host: {host}:{port}\r\nX-Engine-Key: {key}\r\nAccept: text/event-stream\r\n\r\n"
        ).encode()

    transports: list[asyncio.BaseTransport] = []
    gate = asyncio.Semaphore(open_concurrency)

    async def open_one(task_id: str) -> _Conn:
        async with gate:
            opened: asyncio.Future[None] = loop.create_future()
            transport, conn = await loop.create_connection(
                lambda: _Conn(request(task_id), opened), host, port
            )
            transports.append(transport)
            await asyncio.wait_for(opened, 60)
            return conn

    async def open_all(n: int) -> tuple[list[_Conn], float]:
        start = time.perf_counter()
        conns = await asyncio.gather(*(open_one(task_ids[i % tasks]) for i in range(n)))
        return list(conns), time.perf_counter() - start

    try:
        # Warm the replay path (first-use allocations are not per connection).
        await open_all(min(20, connections))
        for t in transports:
            t.close()
        transports.clear()
        await asyncio.sleep(1.0)
        gc.collect()
        rss_before = gateway.memory_info().rss

        conns, open_seconds = await open_all(connections)
        await asyncio.sleep(heartbeat_seconds + 0.5)
        rss_open = gateway.memory_info().rss
        for c in conns:
            c.heartbeats.clear()  # gaps are timed from here: opening crowds the loop
            c.server_ms.clear()
        cpu0 = sum(gateway.cpu_times()[:2])
        t0 = time.perf_counter()
        await asyncio.sleep(hold_seconds)
        cpu_pct = 100 * (sum(gateway.cpu_times()[:2]) - cpu0) / (time.perf_counter() - t0)
        rss_end = gateway.memory_info().rss
    finally:
        for t in transports:
            t.close()
    gaps = [b - a for c in conns for a, b in pairwise(c.heartbeats)]
    server_gaps = [(b - a) / 1000 for c in conns for a, b in pairwise(c.server_ms)]
    return Idle(
        connections=connections,
        tasks=tasks,
        heartbeat_seconds=heartbeat_seconds,
        open_seconds=open_seconds,
        create_seconds=create_seconds,
        rss_before=rss_before,
        rss_open=rss_open,
        rss_end=rss_end,
        gaps=gaps,
        server_gaps=server_gaps,
        ended_early=sum(1 for c in conns if c.ended),
        failed=sum(1 for c in conns if c.error is not None),
        gateway_cpu_pct=cpu_pct,
    )


def _frames_end(buf: bytes) -> int:
    """Where the last complete SSE frame in ``buf`` ends (0: none yet)."""
    crlf, lf = buf.rfind(b"\r\n\r\n"), buf.rfind(b"\n\n")
    return max(crlf + 4 if crlf >= 0 else 0, lf + 2 if lf >= 0 else 0)
