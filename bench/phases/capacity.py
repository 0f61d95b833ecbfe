"""Capacity: the most concurrent live turns, each streaming 50 text deltas/s from the
provider, that this machine carries with the delta's provider → client latency
p99 ≤ 100 ms.

Each turn is ``/script`` with ``delay_ms`` 20 and ``stamp``: the scripted
provider in the loop-worker writes ``time.time()`` into every delta as it
yields it, and the client subtracts it from its own ``time.time()`` when the
chunk carrying the frame arrives (one wall clock for every process on the
machine), so the latency covers the worker's emitter, the append, the
gateway's fan-out, SSE and the client's own event loop. Steps go up through
``--capacity-steps``; the turns of a step are posted a few at a time, and
only the window in which all of them stream is timed. The first step whose
p99 passes 100 ms ends the search; the row reports the last step within it.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field

from bench import scenarios
from bench.context import Context, run_async
from bench.live_raw import post_stream
from bench.sse import StreamError
from bench.table import Row

TARGET_MS = 100.0
GOAL_TURNS = 1000
DELTAS_PER_SECOND = 50
WORKERS = 2
# Turns posted at once while a step ramps up: each new turn takes PostgreSQL
# sessions at once in its worker (as in the idle row).
POST_CONCURRENCY = 16
_STAMP = re.compile(rb'"text":"@(\d+\.\d+)"')
_END = re.compile(rb'"phase":"(completed|errored)"')


@dataclass(slots=True)
class _Turn:
    """One live turn's stream: its deltas' latencies inside the timed window."""

    started: float = 0.0  # time.time() of its first delta
    deltas: int = 0
    first_stamp: float = 0.0
    last_stamp: float = 0.0
    phase: str = ""
    latencies: list[float] = field(default_factory=list)
    _buf: bytes = b""

    def feed(self, chunk: bytes, now: float, window: tuple[float, float]) -> None:
        buf = self._buf + chunk
        # Up to the last complete frame (the gateway ends frames with CRLF CRLF).
        end = _frames_end(buf)
        if not end:
            self._buf = buf
            return
        region, self._buf = buf[:end], buf[end:]
        stamps = _STAMP.findall(region)
        if stamps:
            if not self.started:
                self.started = now
                self.first_stamp = float(stamps[0])
            self.deltas += len(stamps)
            self.last_stamp = float(stamps[-1])
            lo, hi = window
            if lo <= now <= hi:
                self.latencies.extend(now - float(s) for s in stamps)
        ended = _END.search(region)
        if ended:
            self.phase = ended.group(1).decode()


@dataclass
class Step:
    turns: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    samples: int
    window: float
    rate_per_turn: float  # deltas/s a turn's provider achieved, mean
    ramp_seconds: float
    ends_at: float  # time.time() by which the step's turns have ended in the worker
    cpu: str = ""

    @property
    def ok(self) -> bool:
        return self.p99_ms <= TARGET_MS


async def live_turns(url: str, key: str, turns: int, hold: float) -> Step:
    """``turns`` concurrent turns at 50 deltas/s; latency over ``hold`` seconds
    while all of them stream."""
    ramp_estimate = turns / 40 + 2  # posting ~40 turns/s at worst, loaded
    seconds = ramp_estimate + hold + 3
    deltas = math.ceil(seconds * DELTAS_PER_SECOND)
    body = {
        "message": scenarios.script(
            text="x", deltas=deltas, delay_ms=1000 / DELTAS_PER_SECOND, stamp=True
        )
    }
    gate = asyncio.Semaphore(POST_CONCURRENCY)
    states = [_Turn() for _ in range(turns)]
    # Timed window, as time.time(): set once every turn streams.
    window = [math.inf, -math.inf]
    all_streaming = asyncio.Event()

    async def one(turn: _Turn) -> None:
        released = False
        clock = time.time

        def on_body(chunk: bytes) -> bool:
            nonlocal released
            turn.feed(chunk, clock(), (window[0], window[1]))
            if not released and turn.started:
                released = True
                gate.release()
                if all(t.started for t in states):
                    all_streaming.set()
            return bool(turn.phase)

        await gate.acquire()
        try:
            await post_stream(url, key, body, on_body)
        finally:
            if not released:
                gate.release()
        if turn.phase != "completed":
            raise StreamError(f"a live turn ended {turn.phase or 'without its end'!r}")

    t0 = time.time()
    runners = [asyncio.create_task(one(t)) for t in states]
    try:
        waiter = asyncio.create_task(all_streaming.wait())
        done, _ = await asyncio.wait([waiter, *runners], return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            for r in done:
                r.result()  # a turn that failed while ramping
            raise StreamError("a live turn ended before all had started")
        ramp = time.time() - t0
        window[0] = time.time() + 0.5
        window[1] = window[0] + hold
        await asyncio.sleep(hold + 0.5)
    finally:
        # The rest of each turn is not timed: stop reading (the turns run on,
        # briefly, in the worker).
        for r in runners:
            r.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
    latencies = [x * 1000 for t in states for x in t.latencies]
    if not latencies:
        raise StreamError("no delta arrived inside the timed window")
    rates = [
        (t.deltas - 1) / (t.last_stamp - t.first_stamp)
        for t in states
        if t.deltas > 1 and t.last_stamp > t.first_stamp
    ]
    return Step(
        turns=turns,
        p50_ms=scenarios.percentile(latencies, 50),
        p99_ms=scenarios.percentile(latencies, 99),
        max_ms=max(latencies),
        samples=len(latencies),
        window=hold,
        rate_per_turn=sum(rates) / len(rates) if rates else math.nan,
        ramp_seconds=ramp,
        ends_at=t0 + seconds + 1,
    )


def _step(ctx: Context, turns: int) -> Step:
    engine = ctx.engine
    return run_async(
        lambda: live_turns(engine.gateway_url, engine.api_key, turns, ctx.sizes.capacity_hold),
        ctx.use_uvloop,
    )


def run(ctx: Context) -> list[Row]:
    s = ctx.sizes
    rows: list[Row] = []
    top = max(s.capacity_steps)
    # Every turn of the largest step must run at once on the workers.
    ctx.set_workers(WORKERS, math.ceil(top / WORKERS) + 10)
    steps: list[Step] = []
    label = f"Capacity: live turns at {DELTAS_PER_SECOND} deltas/s, p99 ≤ {TARGET_MS:g} ms"
    for turns in s.capacity_steps:
        ctx.say(f"capacity: {turns} live turns")
        step = None
        with ctx.errors_to(rows, f"capacity step {turns} turns"), ctx.measured() as (cpu, _pg):
            step = _step(ctx, turns)
        if step is None:
            break
        # The step's turns stream on, untimed, past the window: let them end before
        # the next step.
        time.sleep(max(0.0, step.ends_at - time.time()))
        step.cpu = cpu.summary()
        steps.append(step)
        ctx.say(
            f"capacity: {turns} turns p50 {step.p50_ms:.1f} ms p99 {step.p99_ms:.1f} ms, "
            f"{step.rate_per_turn:.1f} deltas/s a turn; {step.cpu}"
        )
        if not step.ok:
            break
    if not steps:
        return rows
    passed = [x for x in steps if x.ok]
    best = passed[-1].turns if passed else 0
    tried = "; ".join(
        f"{x.turns}: p50 {x.p50_ms:.1f} / p99 {x.p99_ms:.1f} / max {x.max_ms:.0f} ms, "
        f"{x.rate_per_turn:.1f} deltas/s a turn ({x.samples:,} deltas timed), CPU {x.cpu}"
        for x in steps
    )
    capped = steps[-1].ok
    rows.append(
        Row(
            label,
            f"{'≥ ' if capped else ''}{best:,} turns",
            target=f"≥ {GOAL_TURNS:,} turns",
            detail=f"{WORKERS} loop-workers, 1 gateway; each turn's deltas "
            f"{1000 / DELTAS_PER_SECOND:g} ms apart from the scripted provider, stamped "
            f"as yielded; timed {s.capacity_hold:g} s once all streamed; "
            + ("every step passed (more may fit). " if capped else "")
            + f"Steps (turns: latency, CPU): {tried}",
            ok=best >= GOAL_TURNS,
        )
    )
    return rows


def _frames_end(buf: bytes) -> int:
    """Where the last complete SSE frame in ``buf`` ends (0: none yet)."""
    crlf, lf = buf.rfind(b"\r\n\r\n"), buf.rfind(b"\n\n")
    return max(crlf + 4 if crlf >= 0 else 0, lf + 2 if lf >= 0 else 0)
