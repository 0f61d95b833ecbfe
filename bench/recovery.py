"""Recovery: a loop-worker SIGKILLed mid-turn, and what snapshots cost while nothing fails.

* Takeover gap. Loop-workers with the default liveness TTL and lease
  (``HOLDFAST_LIVENESS_SECONDS`` and ``HOLDFAST_LEASE_SECONDS`` unset: 2 s
  and 10 s). Each round starts slow turns on new tasks
  (``/script {"text": "x", "deltas": 400, "delay_ms": 50}``: 20 s of deltas),
  waits until every one is streaming, finds the worker holding the most of
  them (PostgreSQL ``turns.lease_owner`` is ``<hostname>-<pid>``), waits a
  random 0 to 3.5 s (the lease is renewed every lease/3 s and the liveness key
  every 0.5 s, so the kill lands at a random point of both cycles) and SIGKILLs
  it. For every turn that worker held, the gap is the time from the kill to the client receiving
  the turn's next event written by another worker — its ``turn_resumed``.
  A replacement worker is started at once; at the end of the round the turns
  are cancelled (``POST /execute/cancel``) and read to their end.
* Snapshot cost. ``Snapshots.save`` (one PostgreSQL INSERT of the turn's loop
  state, through the worker's own engine settings) timed directly against
  the bench database; and, inside instrumented loop-workers
  (``bench.instrument``), every ``LiveTurn.snapshot`` (``turn/live.py``): the emitter drain
  plus the one transaction that writes the task's unarchived events, the
  step's message and the state, as a turn pays it at each iteration boundary.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg

from bench import harness
from bench.instrument import Spans
from bench.scenarios import new_client, percentile, script
from bench.sse import Frames, StreamError, stream_frames

SLOW = script(text="x", deltas=400, delay_ms=50)
RENEW_SPREAD_SECONDS = 3.5  # > lease/3 with the default 10 s lease


# -- snapshot cost, measured directly ------------------------------------------------------------
def realistic_state() -> Any:
    """The loop state after a model call that asked for two tools, one already run:
    what a snapshot holds mid-turn (about 1 KB of JSON)."""
    from holdfast_loop_worker.turn_state import PendingCall, TurnState

    return TurnState(
        stage="tools",
        position=7,
        iteration=3,
        usage={
            "input_tokens": 5234,
            "output_tokens": 812,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 4096,
            "reasoning_tokens": 0,
        },
        pending=[
            PendingCall(
                id="toolu_01A09q90qw90lq917835lq9",
                name="bash",
                input={"command": "ls -la src && git status --short"},
                outcome={
                    "output": {
                        "exit_code": 0,
                        "stdout": "total 48\n" + "-rw-r--r-- 1 sandbox sandbox 1234 main.py\n" * 12,
                        "stderr": "",
                        "truncated": False,
                    },
                    "error": None,
                },
            ),
            PendingCall(
                id="toolu_01B19r91rw91mr928946mr0",
                name="read_file",
                input={"path": "src/main.py"},
            ),
        ],
        last_seq=214,
        active_ms=8312,
    )


@dataclass
class SnapshotSaves:
    saves_ms: list[float]  # Snapshots.save as the worker runs it
    state_bytes: int
    # The same save on engines configured differently, interleaved with the
    # real one: where its time goes.
    no_ping_ms: list[float] = field(default_factory=list)  # pool_pre_ping off
    no_ping_async_commit_ms: list[float] = field(default_factory=list)  # and no WAL flush wait
    # A step's PostgreSQL write (3 events + the state), interleaved: as one transaction
    # (BEGIN, the events, the snapshot, COMMIT: the path before issue 16) and as one
    # statement (EventLog's Writes: the events a CTE of the snapshot's INSERT).
    step_transaction_ms: list[float] = field(default_factory=list)
    step_statement_ms: list[float] = field(default_factory=list)


async def snapshot_saves(
    database_url: str, saves: int, variant_every: int = 2, warmup: int = 20
) -> SnapshotSaves:
    """``saves`` timed ``Snapshots.save`` calls through the engine's own
    ``create_engine`` (pool_pre_ping on); every ``variant_every``-th one is
    followed by the same save without the pre-ping, and without the pre-ping
    and with ``synchronous_commit=off`` (COMMIT then does not wait for the
    WAL flush)."""
    import json

    from holdfast_loop_worker.turn_state import Snapshots
    from holdfast_shared.db import create_engine, session_factory
    from holdfast_shared.db.engine import to_async_url
    from sqlalchemy.ext.asyncio import create_async_engine

    engines = [
        create_engine(database_url, pool_size=2),
        create_async_engine(to_async_url(database_url), pool_size=2),
        create_async_engine(
            to_async_url(database_url),
            pool_size=2,
            connect_args={"options": "-c synchronous_commit=off"},
        ),
    ]
    snapshots = [
        Snapshots(session_factory(e), active_ttl_seconds=10800, hitl_ttl_seconds=259200)
        for e in engines
    ]
    state = realistic_state()
    out = SnapshotSaves([], len(json.dumps(state.to_json())))
    samples = [out.saves_ms, out.no_ping_ms, out.no_ping_async_commit_ms]
    n = 0
    try:
        for i in range(warmup + saves):
            for which, snaps in enumerate(snapshots):
                if which and i % variant_every:
                    continue
                n += 1
                start = time.perf_counter()
                await snaps.save(
                    "task_019a9c1f2e3d4b5c6d7e8f9a0b1c", f"turn_bench_{n:06d}", "tool_result", state
                )
                if i >= warmup:
                    samples[which].append((time.perf_counter() - start) * 1000)
            if i % variant_every == 0:
                await _step_writes(engines[0], snapshots[0], state, n, out, timed=i >= warmup)
    finally:
        for engine in engines:
            await engine.dispose()
    return out


async def _step_writes(
    engine: Any, snapshots: Any, state: Any, n: int, out: SnapshotSaves, *, timed: bool
) -> None:
    """One step's write both ways, back to back (on the pre-ping engine)."""
    from holdfast_shared.db.models import EventRecord
    from holdfast_shared.eventlog import execute_at_once, one_statement
    from sqlalchemy.dialects.postgresql import insert

    task, turn = f"task_bench_step_{n:06d}", f"turn_bench_step_{n:06d}"

    def rows(first: int) -> list[dict[str, Any]]:
        return [
            {
                "task_id": task,
                "seq": seq,
                "type": "text_delta",
                "timestamp": seq,
                "data": '{"type":"text_delta","text":"x"}',
                "turn_id": turn,
            }
            for seq in range(first, first + 3)
        ]

    start = time.perf_counter()
    async with snapshots.sessions.begin() as session:
        await session.execute(insert(EventRecord).on_conflict_do_nothing(), rows(1))
        snapshots.add(session, task, turn, "model_call", state)
    middle = time.perf_counter()
    events = insert(EventRecord).values(rows(4)).on_conflict_do_nothing()
    snapshot = snapshots.statement(task, turn, "model_call", state)
    await execute_at_once(engine, one_statement([events, snapshot]))  # as EventLog does
    end = time.perf_counter()
    if timed:
        out.step_transaction_ms.append((middle - start) * 1000)
        out.step_statement_ms.append((end - middle) * 1000)


async def quick_turns(url: str, key: str, turns: int) -> None:
    """Sequential short turns (one model call, so one snapshot each) on new tasks."""
    async with new_client() as client:
        for _ in range(turns):
            got = await stream_frames(
                client, "POST", f"{url}/execute", key=key, json_body={"message": "hi there"}
            )
            if got.phase != "completed":
                raise StreamError(f"quick turn ended {got.phase!r}: {got.types()}")


# -- takeover after SIGKILL ----------------------------------------------------------------------
@dataclass
class Kill:
    kill_at: float  # perf_counter
    victims: list[str]  # the turns the killed worker held
    spread: list[int]  # the round's turns per worker, before its kills
    remaining_lease_s: list[float] = field(default_factory=list)  # lease_until - kill
    gaps_s: list[float] = field(default_factory=list)  # kill → turn_resumed at the client
    # From the new worker's spans: kill → it starts announcing the resume
    # (liveness key lapsed, entries claimed, leases ended, lease claimed, snapshot
    # read), and that moment → the client has turn_resumed.
    pickup_s: list[float] = field(default_factory=list)
    resume_ms: list[float] = field(default_factory=list)


@dataclass
class Recovery:
    kills: list[Kill]
    rounds: int
    workers: int
    turns_per_round: int

    def all(self, name: str) -> list[float]:
        return [v for k in self.kills for v in getattr(k, name)]


async def _owners(conn: psycopg.AsyncConnection[Any], turn_ids: list[str]) -> dict[str, Any]:
    cur = await conn.execute(
        "SELECT id, lease_owner, lease_until FROM turns WHERE id = ANY(%s)", (turn_ids,)
    )
    return {row[0]: (row[1], row[2]) for row in await cur.fetchall()}


async def _until(check: Any, limit: float, what: str, engine: harness.Engine) -> None:
    deadline = time.perf_counter() + limit
    while not check():
        if time.perf_counter() > deadline:
            raise StreamError(f"{what}: not within {limit:g} s; {engine.log_tail(5)}")
        await asyncio.sleep(0.01)


@dataclass
class _Setup:
    engine: harness.Engine
    client: Any
    conn: psycopg.AsyncConnection[Any]
    rng: random.Random
    turns: int
    kills: int
    concurrency: int
    worker_env: dict[str, str]
    worker_code: str | None


async def takeovers(
    engine: harness.Engine,
    *,
    rounds: int,
    kills_per_round: int,
    turns: int,
    concurrency: int,
    worker_env: dict[str, str],
    worker_code: str | None,
    seed: int | None = None,
) -> Recovery:
    """``rounds`` rounds; in each, the ``kills_per_round`` workers holding the most
    of the round's slow turns are SIGKILLed, each at its own random moment
    (independent renewal phases), and replaced at once. A killed worker's
    turns cannot go to another killed one: they are taken over only after
    their lease runs out, seconds after the last kill of the round."""
    if kills_per_round >= len(engine.workers):
        raise ValueError(f"{kills_per_round} kills per round need more than that many workers")
    if turns > concurrency:
        raise ValueError(
            f"{turns} turns per round on workers of concurrency {concurrency}: a survivor "
            "could not take them all over at once"
        )
    out = Recovery([], rounds, len(engine.workers), turns)
    conn = await psycopg.AsyncConnection.connect(harness._psycopg_url(engine.database_url))
    await conn.set_autocommit(True)
    try:
        async with new_client() as client:
            setup = _Setup(
                engine,
                client,
                conn,
                random.Random(seed),
                turns,
                kills_per_round,
                concurrency,
                worker_env,
                worker_code,
            )
            for _ in range(rounds):
                out.kills.extend(await _round(setup))
    finally:
        await conn.close()
    return out


async def _round(x: _Setup) -> list[Kill]:
    engine = x.engine
    url, key = engine.gateway_url, engine.api_key
    host = socket.gethostname()
    recs = [Frames() for _ in range(x.turns)]
    readers = [
        asyncio.create_task(
            stream_frames(
                x.client, "POST", f"{url}/execute", key=key, json_body={"message": SLOW}, got=rec
            )
        )
        for rec in recs
    ]
    kills: list[Kill] = []
    try:
        await _until(
            lambda: all(r.first("text_delta") for r in recs), 30, "slow turns streaming", engine
        )
        by_turn = {r.turn_id: r for r in recs if r.turn_id}
        owners = await _owners(x.conn, list(by_turn))
        held = Counter(owner for owner, _ in owners.values() if owner)
        procs = {f"{host}-{p.pid}": p for p in engine.workers}
        order = sorted(procs, key=lambda o: (-held[o], x.rng.random()))
        spread = sorted((held[o] for o in procs), reverse=True)
        delays = sorted(x.rng.uniform(0, RENEW_SPREAD_SECONDS) for _ in range(x.kills))
        start = time.perf_counter()
        replacements = []
        for victim_owner, delay in zip(order, delays, strict=False):
            await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
            kill_at = time.perf_counter()
            kill_wall = datetime.now(UTC)
            engine.kill_worker(procs[victim_owner])
            replacements.append(engine.start_worker(x.concurrency, x.worker_env, x.worker_code))
            owners = await _owners(x.conn, list(by_turn))
            victims = [t for t, (owner, _) in owners.items() if owner == victim_owner]
            kills.append(
                Kill(
                    kill_at=kill_at,
                    victims=victims,
                    spread=spread,
                    remaining_lease_s=[
                        (owners[t][1] - kill_wall).total_seconds() for t in victims if owners[t][1]
                    ],
                )
            )

        def resumed() -> bool:
            return all(
                by_turn[t].first("turn_resumed", after=k.kill_at) for k in kills for t in k.victims
            )

        await _until(resumed, 60, "turns resumed after the kills", engine)
        for kill in kills:
            for t in kill.victims:
                got = by_turn[t].first("turn_resumed", after=kill.kill_at)
                assert got is not None
                kill.gaps_s.append(got[0] - kill.kill_at)
        await engine.until_ready(replacements)
    finally:
        for rec in recs:
            if rec.task_id and not rec.done:
                await x.client.post(
                    f"{url}/execute/cancel",
                    headers={"X-Engine-Key": key},
                    json={"task_id": rec.task_id},
                )
        done = await asyncio.wait_for(asyncio.gather(*readers, return_exceptions=True), 60)
    failed = [d for d in done if isinstance(d, BaseException)]
    if failed:
        raise StreamError(f"a slow turn's stream failed: {failed[0]!r}")
    return [k for k in kills if k.victims]


def attribute(rec: Recovery, spans: Spans) -> None:
    """Split each gap with the new worker's spans (see :class:`Kill`)."""
    for kill in rec.kills:
        for turn_id, gap in zip(kill.victims, kill.gaps_s, strict=True):
            runs = [s for s in spans.of(turn_id, "announce_resume") if s[0] > kill.kill_at]
            if runs:
                pickup = runs[0][0] - kill.kill_at
                kill.pickup_s.append(pickup)
                kill.resume_ms.append((gap - pickup) * 1000)


def summary(values: list[float], unit: str = "s", digits: int = 2) -> str:
    if not values:
        return "n/a"
    return (
        f"p50 {percentile(values, 50):.{digits}f} {unit}, p99 {percentile(values, 99):.{digits}f} "
        f"{unit}, min {min(values):.{digits}f}, max {max(values):.{digits}f}"
    )
