"""Scale on one box: turns/s with a simulated 200 ms model on 1 and 4 loop-workers,
and two gateways behind the same Redis serving one task's stream byte for byte.

Turns/s: closed-loop clients keep ``in_flight`` turns posted (more than every
worker's slots together, so the workers never wait for work); each turn is
``/script`` with one delta after ``delay_ms`` 200, so its time is the model's.
With a fixed HOLDFAST_WORKER_CONCURRENCY per worker the engine's capacity is
its slots, and 4 workers must carry ≥ 3x the turns/s of 1 (the rest is the
claim, the lease, the snapshot and PostgreSQL per turn). Two gateways: a
second gateway process on the same Redis and database; concurrent turns, each
read from seq 0 on both gateways while it streams (``GET /execute/replay``);
every frame with an id must be the same bytes on both.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from dataclasses import dataclass

import httpx

from bench import harness, scenarios
from bench.context import Context, run_async
from bench.sse import StreamError, stream
from bench.table import Row

TARGET_RATIO = 3.0
MODEL_MS = 200
# Slots per loop-worker: fixed, so worker count is what scales.
SLOTS = 4
WORKERS = (1, 4)
GATEWAY_TASKS = 10
GATEWAY_DELTAS = 500


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    rows += _turns_rows(ctx)
    rows += _gateway_rows(ctx)
    return rows


# -- turns/s, 1 → 4 loop-workers ------------------------------------------------------------------
@dataclass
class TurnRate:
    turns: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def rate(self) -> float:
        return self.turns / self.seconds


async def turns_per_second(url: str, key: str, turns: int, in_flight: int) -> TurnRate:
    body = {"message": scenarios.script(text="x", deltas=1, delay_ms=MODEL_MS)}
    gate = asyncio.Semaphore(in_flight)
    took: list[float] = []

    async def one(client: httpx.AsyncClient) -> None:
        async with gate:
            t0 = time.perf_counter()
            got = await stream(client, "POST", f"{url}/execute", key=key, json_body=body)
            if got.phase != "completed" or got.deltas != 1:
                raise StreamError(f"turn {got.task_id} ended {got.phase!r} {got.errors}")
            took.append((time.perf_counter() - t0) * 1000)

    async with scenarios.new_client() as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client) for _ in range(turns)))
        seconds = time.perf_counter() - start
    return TurnRate(turns, seconds, scenarios.percentile(took, 50), scenarios.percentile(took, 99))


def _turns_rows(ctx: Context) -> list[Row]:
    s = ctx.sizes
    rows: list[Row] = []
    in_flight = 2 * SLOTS * max(WORKERS)
    rates: dict[int, TurnRate] = {}
    details: list[str] = []
    for workers in WORKERS:
        label = f"turns/s, {MODEL_MS} ms model, {workers} loop-worker" + (
            "s" if workers > 1 else ""
        )
        ctx.set_workers(workers, SLOTS)
        turns = s.scale_turns * workers
        ctx.say(f"{label}: {turns} turns, {in_flight} in flight")
        with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
            rates[workers] = _measure_turns(ctx, turns, in_flight)
        if workers in rates:
            r = rates[workers]
            details.append(
                f"{workers} worker(s): {r.turns} turns in {r.seconds:.1f} s, POST → end of turn "
                f"p50 {r.p50_ms:.0f} ms p99 {r.p99_ms:.0f} ms; CPU {cpu.summary()}; {pg.summary()}"
            )
    if len(rates) < len(WORKERS):
        return rows
    one, many = rates[WORKERS[0]], rates[WORKERS[-1]]
    ratio = many.rate / one.rate
    ideal = SLOTS * 1000 / MODEL_MS
    rows.append(
        Row(
            f"turns/s, {MODEL_MS} ms model, {WORKERS[0]} → {WORKERS[-1]} loop-workers",
            f"{one.rate:.1f}/s → {many.rate:.1f}/s",
            f"{one.rate:.1f}/s (1 worker)",
            f"{ratio:.2f}",
            f"≥ {TARGET_RATIO:g}",
            f"HOLDFAST_WORKER_CONCURRENCY={SLOTS} per worker (slot-bound: at most "
            f"{ideal:.0f} turns/s a worker), {in_flight} turns in flight from the client, "
            f"each one delta after {MODEL_MS} ms. " + " | ".join(details),
            ok=ratio >= TARGET_RATIO,
        )
    )
    return rows


def _measure_turns(ctx: Context, turns: int, in_flight: int) -> TurnRate:
    engine = ctx.engine
    return run_async(
        lambda: turns_per_second(engine.gateway_url, engine.api_key, turns, in_flight),
        ctx.use_uvloop,
    )


# -- two gateways, one stream ---------------------------------------------------------------------
_ID = re.compile(rb"^id: ?(\d+)\r?$", re.M)


def frames_by_seq(body: bytes) -> dict[int, bytes]:
    """The frames of an SSE body that carry an id, by it (heartbeats have none)."""
    out: dict[int, bytes] = {}
    for frame in re.split(rb"\r?\n\r?\n", body):
        match = _ID.search(frame)
        if match:
            out[int(match.group(1))] = frame
    return out


async def _read_all(client: httpx.AsyncClient, url: str, key: str, task_id: str) -> bytes:
    async with client.stream(
        "GET",
        f"{url}/execute/replay",
        params={"task_id": task_id, "after_seq": 0},
        headers={"X-Engine-Key": key},
    ) as response:
        if response.status_code != 200:
            raise StreamError(f"replay on {url}: HTTP {response.status_code}")
        return b"".join([chunk async for chunk in response.aiter_raw()])


@dataclass
class SameStream:
    tasks: int
    frames: int
    mismatched: int
    missing: int
    bytes: int


async def same_stream(urls: tuple[str, str], key: str, tasks: int, deltas: int) -> SameStream:
    """``tasks`` turns posted on the first gateway, each read from seq 0 on both while
    it streams; frames compared by seq."""
    body = {"message": scenarios.script(text="x", deltas=deltas, delay_ms=2)}
    async with scenarios.new_client() as client:

        async def one() -> tuple[dict[int, bytes], dict[int, bytes]]:
            got = await stream(
                client,
                "POST",
                f"{urls[0]}/execute",
                key=key,
                json_body=body,
                stop_after_started=True,
            )
            assert got.task_id
            a, b = await asyncio.gather(*(_read_all(client, u, key, got.task_id) for u in urls))
            return frames_by_seq(a), frames_by_seq(b)

        pairs = await asyncio.gather(*(one() for _ in range(tasks)))
    frames = mismatched = missing = size = 0
    for a, b in pairs:
        if len(a) < deltas:
            raise StreamError(f"a stream carried {len(a)} frames, fewer than its {deltas} deltas")
        missing += len(a.keys() ^ b.keys())
        for seq in a.keys() & b.keys():
            frames += 1
            size += len(a[seq])
            mismatched += a[seq] != b[seq]
    return SameStream(tasks, frames, mismatched, missing, size)


def _gateway_rows(ctx: Context) -> list[Row]:
    engine = ctx.engine
    rows: list[Row] = []
    label = "2 gateways, same Redis: one task's SSE frames"
    ctx.set_workers(1, ctx.workers_for(1))
    ctx.say(f"{label}: second gateway")
    second = engine.environment.start("gateway", within=harness.READY_SECONDS)
    try:
        assert second.url
        urls = (engine.gateway_url, second.url)
        result = None
        with ctx.errors_to(rows, label):
            result = run_async(
                lambda: same_stream(urls, engine.api_key, GATEWAY_TASKS, GATEWAY_DELTAS),
                ctx.use_uvloop,
            )
    finally:
        engine.environment.kill(second, signal.SIGTERM)
    if result is not None:
        ok = result.mismatched == 0 and result.missing == 0
        rows.append(
            Row(
                label,
                "identical" if ok else f"{result.mismatched + result.missing} differ",
                target="byte-identical by seq",
                detail=f"{result.tasks} concurrent turns of {GATEWAY_DELTAS} deltas (2 ms apart) "
                f"posted on gateway 1; each read from seq 0 on both gateways while it streamed "
                f"(GET /execute/replay): {result.frames:,} frames ({result.bytes:,} bytes) "
                f"compared, {result.mismatched} differ, {result.missing} on one gateway only",
                ok=ok,
            )
        )
    return rows
