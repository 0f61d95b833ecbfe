"""What durability costs and how fast it recovers: a snapshot save (direct, and per
iteration in instrumented workers), and the takeover gap after a loop-worker is
SIGKILLed mid-turn with the default liveness TTL and lease.

See ``bench.recovery``.
"""

from __future__ import annotations

import math
import os
import time

from bench import recovery, scenarios
from bench.context import SMALL_CONCURRENCY, Context, run_async
from bench.instrument import WORKER_CODE, Spans
from bench.table import Row

TARGET_TAKEOVER_P99_S = 3.0
TARGET_SNAPSHOT_MS = 5.0
RECOVERY_WORKERS = 3
DEFAULT_LEASE_SECONDS = 10  # HOLDFAST_LEASE_SECONDS's default, left unset by the bench
DEFAULT_LIVENESS_SECONDS = 2  # HOLDFAST_LIVENESS_SECONDS's default, likewise


def run(ctx: Context) -> list[Row]:
    s, engine, pct = ctx.sizes, ctx.engine, scenarios.percentile
    rows: list[Row] = []
    label = "Snapshot save (Snapshots.save: one PostgreSQL INSERT)"
    ctx.say(f"{label}: {s.snapshot_saves} saves")
    ss = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
        ss = run_async(
            lambda: recovery.snapshot_saves(engine.database_url, s.snapshot_saves), False
        )
    if ss is not None:
        p50 = pct(ss.saves_ms, 50)
        rows.append(
            Row(
                label,
                f"p50 {p50:.2f} ms\np99 {pct(ss.saves_ms, 99):.2f} ms",
                target=f"≤ {TARGET_SNAPSHOT_MS:g} ms p50",
                detail=f"{len(ss.saves_ms)} saves of a {ss.state_bytes:,}-byte mid-turn state "
                f"(2 pending tool calls, one with its output) straight to the bench database "
                f"through the engine's create_engine (pool_pre_ping on), stdlib asyncio. "
                f"Interleaved, the same save without the pre-ping: p50 "
                f"{pct(ss.no_ping_ms, 50):.2f} ms; and also with synchronous_commit=off "
                f"(COMMIT does not wait for the WAL flush): p50 "
                f"{pct(ss.no_ping_async_commit_ms, 50):.2f} ms. A step's write (3 events + "
                f"the state), interleaved: as one transaction (the path before issue 16) p50 "
                f"{pct(ss.step_transaction_ms, 50):.2f} ms, as one statement (EventLog's "
                f"Writes) p50 {pct(ss.step_statement_ms, 50):.2f} ms. CPU: {cpu.summary()}",
                ok=p50 <= TARGET_SNAPSHOT_MS,
            )
        )
    label = "Snapshot per iteration in a loop-worker (drain + one SQL statement)"
    spans: Spans | None = None
    with ctx.errors_to(rows, label):
        spans, _server = ctx.instrumented(RECOVERY_WORKERS)
        ctx.pause("recovery")
        ctx.say(f"{label}: {s.snapshot_turns} short turns")
        start = time.perf_counter()
        with ctx.measured() as (cpu, pg):
            run_async(
                lambda: recovery.quick_turns(engine.gateway_url, engine.api_key, s.snapshot_turns),
                ctx.use_uvloop,
            )
        window = (start, time.perf_counter())
        spans.reload()
        total = spans.durations_ms("snapshot", window=window)
        drain = spans.durations_ms("snapshot.drain", window=window)
        write = spans.durations_ms("snapshot.write", window=window)
        if not total:
            raise RuntimeError("the instrumented workers recorded no snapshot")
        rows.append(
            Row(
                label,
                f"p50 {pct(total, 50):.2f} ms\np99 {pct(total, 99):.2f} ms",
                target=f"≤ {TARGET_SNAPSHOT_MS:g} ms p50",
                detail=f"{len(total)} LiveTurn.snapshot calls (one per model call) in "
                f"{s.snapshot_turns} sequential short turns on {RECOVERY_WORKERS} instrumented "
                f"workers: waiting for the emitter to drain p50 {pct(drain, 50):.2f} ms, p99 "
                f"{pct(drain, 99):.2f} ms; the task's unarchived events, the step's message "
                f"and the state as one PostgreSQL statement (data-modifying CTEs, no "
                f"BEGIN/COMMIT; EventLog.archive_now with Writes, between two Redis calls) "
                f"p50 {pct(write, 50):.2f} ms, p99 {pct(write, 99):.2f} ms. CPU: "
                f"{cpu.summary()}. {pg.summary()}",
                ok=pct(total, 50) <= TARGET_SNAPSHOT_MS,
            )
        )
    label = "Worker SIGKILL → the turn's next event from another worker"
    if spans is None:
        return rows
    kills = s.recovery_kills
    ctx.say(
        f"{label}: {s.recovery_rounds} rounds of {s.recovery_turns} slow turns on "
        f"{RECOVERY_WORKERS} workers, {kills} SIGKILLs each, default liveness and lease"
    )
    rec = None
    started = time.perf_counter()
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
        rec = run_async(
            lambda: recovery.takeovers(
                engine,
                rounds=s.recovery_rounds,
                kills_per_round=kills,
                turns=s.recovery_turns,
                concurrency=SMALL_CONCURRENCY,
                worker_env=ctx.instrumented_env,
                worker_code=WORKER_CODE,
            ),
            ctx.use_uvloop,
        )
    if rec is None:
        ctx.worker_setup = None  # some workers may be gone
        return rows
    spans.reload()
    recovery.attribute(rec, spans)
    gaps = rec.all("gaps_s")
    lease = rec.all("remaining_lease_s")
    pickup = rec.all("pickup_s")
    resume = rec.all("resume_ms")
    spread = "; ".join(sorted({"/".join(map(str, k.spread)) for k in rec.kills}))
    rows.append(
        Row(
            f"{label} (default {DEFAULT_LIVENESS_SECONDS} s liveness TTL, "
            f"{DEFAULT_LEASE_SECONDS} s lease)",
            f"p50 {pct(gaps, 50):.2f} s\np99 {pct(gaps, 99):.2f} s",
            target=f"p99 ≤ {TARGET_TAKEOVER_P99_S:g} s",
            detail=f"{len(gaps)} turns over {len(rec.kills)} SIGKILLs in {rec.rounds} rounds "
            f"({RECOVERY_WORKERS} workers; {rec.turns_per_round} slow turns per round, per "
            f"worker {spread}; the {kills} workers holding the most killed each at its own "
            f"random moment 0-3.5 s after all streamed, and replaced); gap = kill → client "
            f"receives turn_resumed; min {min(gaps):.2f} s, max {max(gaps):.2f} s. The "
            f"killed worker's liveness key lapses, a live worker claims its entries, ends its "
            f"leases and resumes the turns (holdfast_shared.liveness). Lease left at the kill "
            f"p50 {pct(lease, 50):.2f} s (min {min(lease, default=math.nan):.2f}, "
            f"max {max(lease, default=math.nan):.2f}); kill → the new worker starts announcing "
            f"the resume p50 {pct(pickup, 50):.2f} s; → client has turn_resumed p50 "
            f"{pct(resume, 50):.0f} ms. {time.perf_counter() - started:.0f} s in all; machine "
            f"CPU {cpu.machine:.0f}% of {100 * (os.cpu_count() or 1)}%. {pg.summary()}",
            ok=pct(gaps, 99) <= TARGET_TAKEOVER_P99_S,
        )
    )
    return rows
