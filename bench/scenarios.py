"""The engine measurements: streaming throughput, POST→started latency, idle SSE."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import time
from dataclasses import dataclass, field
from itertools import pairwise

import httpx
import psutil

from bench.sse import SSECount, StreamError, parse_rate, stream


def script(**fields: object) -> str:
    return "/script " + json.dumps(fields)


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (``pct`` in 0..100)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def new_client(timeout: float = 120) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout, connect=30),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


def _check_turn(got: SSECount, deltas: int) -> None:
    if got.phase != "completed" or got.deltas != deltas:
        raise StreamError(
            f"turn {got.task_id} ended {got.phase!r} with {got.deltas}/{deltas} deltas {got.errors}"
        )


# -- 2. end-to-end text_delta throughput ---------------------------------------------------------
@dataclass
class Throughput:
    tasks: int
    deltas_per_task: int
    from_post: float  # deltas/s, first POST sent → last delta received
    steady: float  # deltas/s, first delta received → last delta received
    wall: float
    chunks: int
    recorded: list[bytes] = field(default_factory=list, repr=False)

    @property
    def total(self) -> int:
        return self.tasks * self.deltas_per_task


async def single_task(url: str, key: str, deltas: int) -> Throughput:
    record: list[bytes] = []
    async with new_client() as client:
        got = await stream(
            client,
            "POST",
            f"{url}/execute",
            key=key,
            json_body={"message": script(text="x", deltas=deltas)},
            record=record,
        )
    _check_turn(got, deltas)
    return Throughput(
        tasks=1,
        deltas_per_task=deltas,
        from_post=deltas / (got.last_delta_at - got.opened_at),
        steady=deltas / max(got.last_delta_at - got.first_delta_at, 1e-9),
        wall=got.ended_at - got.opened_at,
        chunks=got.chunks,
        recorded=record,
    )


async def concurrent_tasks(url: str, key: str, tasks: int, deltas: int) -> Throughput:
    counts = [SSECount() for _ in range(tasks)]
    body = {"message": script(text="x", deltas=deltas)}
    async with new_client() as client:
        start = time.perf_counter()
        await asyncio.gather(
            *(
                stream(client, "POST", f"{url}/execute", key=key, json_body=body, count=c)
                for c in counts
            )
        )
    for got in counts:
        _check_turn(got, deltas)
    last = max(c.last_delta_at for c in counts)
    first = min(c.first_delta_at for c in counts)
    total = tasks * deltas
    return Throughput(
        tasks=tasks,
        deltas_per_task=deltas,
        from_post=total / (last - start),
        steady=total / max(last - first, 1e-9),
        wall=max(c.ended_at for c in counts) - start,
        chunks=sum(c.chunks for c in counts),
    )


async def warm_up(url: str, key: str, turns: int, deltas: int = 500) -> None:
    """A few concurrent turns, so fresh processes pay their first-use costs
    (imports, statement caches, pool connections) before anything is timed."""
    body = {"message": script(text="x", deltas=deltas)}
    async with new_client() as client:
        for _ in range(2):
            done = await asyncio.gather(
                *(
                    stream(client, "POST", f"{url}/execute", key=key, json_body=body)
                    for _ in range(turns)
                )
            )
            for got in done:
                _check_turn(got, deltas)


def client_parse_rate(recorded: list[bytes]) -> tuple[float, int]:
    return parse_rate(recorded)


# -- 3. POST → started latency --------------------------------------------------------------------
@dataclass
class Latency:
    samples_ms: list[float]

    @property
    def p50(self) -> float:
        return percentile(self.samples_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.samples_ms, 99)

    @property
    def max(self) -> float:
        return max(self.samples_ms)


async def post_to_started(url: str, key: str, posts: int, warmup: int = 10) -> Latency:
    """Sequential POSTs on new tasks; each stream is read to the end of its turn,
    so turns never pile up; only send → ``started`` frame is timed."""
    samples: list[float] = []
    async with new_client() as client:
        for i in range(warmup + posts):
            got = await stream(
                client, "POST", f"{url}/execute", key=key, json_body={"message": "hi there"}
            )
            if not got.started_at or got.phase != "completed":
                raise StreamError(f"latency POST ended {got.phase!r} {got.errors}")
            if i >= warmup:
                samples.append((got.started_at - got.opened_at) * 1000)
    return Latency(samples)


# -- 4. idle SSE connections ----------------------------------------------------------------------
@dataclass
class Idle:
    connections: int
    tasks: int
    heartbeat_seconds: float
    open_seconds: float
    create_seconds: float
    rss_before: int
    rss_open: int
    rss_end: int
    gaps: list[float]
    server_gaps: list[float]
    ended_early: int
    failed: int
    gateway_cpu_pct: float

    @property
    def kb_per_connection(self) -> float:
        return (max(self.rss_open, self.rss_end) - self.rss_before) / 1024 / self.connections

    @property
    def on_time_limit(self) -> float:
        return self.heartbeat_seconds + 1.0

    @property
    def late(self) -> int:
        return sum(1 for g in self.gaps if g > self.on_time_limit)


async def _hold_open(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    task_id: str,
    got: SSECount,
    gate: asyncio.Semaphore,
    opened: list[int],
) -> None:
    await gate.acquire()
    released = False
    try:
        async with client.stream(
            "GET",
            f"{url}/execute/replay",
            params={"task_id": task_id, "after_seq": 0},
            headers={"X-Engine-Key": key},
        ) as response:
            if response.status_code != 200:
                raise StreamError(f"replay HTTP {response.status_code}")
            perf = time.perf_counter
            async for chunk in response.aiter_raw():
                got.feed(chunk, perf())
                if not released:
                    released = True
                    gate.release()
                    opened[0] += 1
                if got.done:
                    return
    finally:
        if not released:
            gate.release()


async def _wait_open(
    holders: list[asyncio.Task[None]], opened: list[int], n: int, limit_seconds: float = 120
) -> None:
    deadline = time.perf_counter() + limit_seconds
    while opened[0] < n:
        failed = [h for h in holders if h.done()]
        if failed:
            exc = failed[0].exception() if not failed[0].cancelled() else None
            raise StreamError(f"an idle stream ended while opening: {exc!r}")
        if time.perf_counter() > deadline:
            raise StreamError(f"only {opened[0]}/{n} idle streams opened in {limit_seconds:g} s")
        await asyncio.sleep(0.05)


async def idle_connections(
    url: str,
    key: str,
    gateway_pid: int,
    *,
    connections: int,
    tasks: int,
    hold_seconds: float,
    heartbeat_seconds: float,
    open_concurrency: int = 50,
    create_concurrency: int = 8,
) -> Idle:
    gateway = psutil.Process(gateway_pid)
    # Quiet turns: one delta after a pause far longer than the bench; the
    # bench's teardown kills the worker that holds them.
    quiet = {"message": script(text="x", deltas=1, delay_ms=3_600_000)}
    gate = asyncio.Semaphore(open_concurrency)
    # Turns are created a few at a time: every turn a worker picks up takes
    # PostgreSQL sessions at once, and its pool keeps what a burst opened.
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

        # Warm the replay path (first-use allocations are not per connection).
        warm = [SSECount() for _ in range(min(20, connections))]
        opened = [0]
        warmers = [
            asyncio.create_task(_hold_open(client, url, key, task_ids[i % tasks], w, gate, opened))
            for i, w in enumerate(warm)
        ]
        try:
            await _wait_open(warmers, opened, len(warm))
        finally:
            for w in warmers:
                w.cancel()
            await asyncio.gather(*warmers, return_exceptions=True)
        await asyncio.sleep(1.0)
        gc.collect()
        rss_before = gateway.memory_info().rss

        counts = [SSECount() for _ in range(connections)]
        opened = [0]
        start = time.perf_counter()
        holders = [
            asyncio.create_task(_hold_open(client, url, key, task_ids[i % tasks], c, gate, opened))
            for i, c in enumerate(counts)
        ]
        try:
            await _wait_open(holders, opened, connections)
            open_seconds = time.perf_counter() - start
            await asyncio.sleep(heartbeat_seconds + 0.5)
            rss_open = gateway.memory_info().rss

            cpu0 = sum(gateway.cpu_times()[:2])
            t0 = time.perf_counter()
            await asyncio.sleep(hold_seconds)
            cpu_pct = 100 * (sum(gateway.cpu_times()[:2]) - cpu0) / (time.perf_counter() - t0)
            rss_end = gateway.memory_info().rss

            ended_early = sum(1 for h in holders if h.done())
            failed_n = sum(1 for h in holders if h.done() and not h.cancelled() and h.exception())
        finally:
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)

    gaps = [b - a for c in counts for a, b in pairwise(c.heartbeats)]
    server_gaps = [(b - a) / 1000 for c in counts for a, b in pairwise(c.heartbeat_server_ms)]
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
        ended_early=ended_early,
        failed=failed_n,
        gateway_cpu_pct=cpu_pct,
    )
