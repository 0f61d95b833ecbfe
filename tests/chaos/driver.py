"""The chaos driver: kills and restarts processes on a schedule while the load runs.

One action at a time, on a clock: a loop-worker every few seconds, a
tool-runner and a gateway now and then (each replaced at once, the
replacement not waited for), Redis crashed (``kill -9``) and restarted at
fixed moments, and one full restart — every engine process and Redis
SIGKILLed together — once the HITL prompts are out. Processes that exit on
their own are restarted, as ``holdfast up`` or compose would, and counted.
Alongside the kills, stalls: a random worker, tool-runner, gateway or the
Redis server SIGSTOPped for a random few seconds, then SIGCONTed (a stopped
container, a starved CPU, a long GC pause). One stall at a time; a process is
woken before any kill or restart of it, and every stall ends when the
driver does, so nothing is left stopped.
Bounded: it stops when the load is done or its time is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from holdfast.testing import time_scale
from tests.chaos.client import Turn
from tests.chaos.cluster import ChaosCluster

STALL_KINDS = ("worker", "runner", "gateway", "redis")
STALL_REDIS_ENV = "HOLDFAST_CHAOS_STALL_REDIS"
STALL_WORKERS_ENV = "HOLDFAST_CHAOS_STALL_WORKERS"
STALL_GATEWAYS_ENV = "HOLDFAST_CHAOS_STALL_GATEWAYS"


def stall_kinds() -> tuple[str, ...]:
    """What the runs stall: tool-runners; gateways too only with
    ``HOLDFAST_CHAOS_STALL_GATEWAYS=1``, loop-workers only with
    ``HOLDFAST_CHAOS_STALL_WORKERS=1``, Redis only with ``HOLDFAST_CHAOS_STALL_REDIS=1``.

    Gateway stalls found two more (2026-11-27, embedded servers). One is fixed:
    a gateway stalled between a turn's commit and its ``started`` past the
    stale sweep's judgement announced a turn the sweep had removed (the epoch
    fence, gateway ``start_turn``). One is open: a POST given up by the client
    while its gateway is stalled starts its turn seconds later, after the
    client looked for it in the log and sent the message again, so one message
    runs as two turns ("events of a turn which no client started"). It wants
    an idempotent ``POST /execute`` (a client's key per message); until then
    CI's runs leave gateway stalls out too.

    Stalls found engine bugs in the soak (#29). One is fixed: a gateway's
    ``start_turn`` that timed out took back a turn whose ``started`` had landed,
    or logged ``errored`` for a turn whose job then ran. Three are not yet, all
    with a loop-worker stalled past its lease around a resume: a parked turn's
    answer logged twice (two ``hitl_resolved`` for one request, ~30 s apart), a
    prompt left pending, and successive resumes whose discard ranges overlap so
    a completed turn's text reads empty. Until they are, CI's runs leave worker
    and Redis stalls out (``tests/chaos/test_paused_worker.py`` still stalls a
    worker deterministically); the switches show the bugs.
    """
    skipped = {
        kind
        for kind, env in (
            ("worker", STALL_WORKERS_ENV),
            ("gateway", STALL_GATEWAYS_ENV),
            ("redis", STALL_REDIS_ENV),
        )
        if os.environ.get(env) != "1"
    }
    return tuple(kind for kind in STALL_KINDS if kind not in skipped)


@dataclass(frozen=True)
class Schedule:
    seconds: float  # the driver stops after this, load or not
    worker_every: tuple[float, float]
    runner_every: tuple[float, float]
    gateway_every: tuple[float, float]
    redis_crashes_at: tuple[float, ...]
    full_restart_window: tuple[float, float]  # not before, not after (prompts or not)
    redis_outage: tuple[float, float]
    counts: dict[str, int]  # kind -> how many run
    stall_every: tuple[float, float] | None = None  # between one stall's end and the next
    stall_seconds: tuple[float, float] = (1.0, 8.0)  # how long, before the machine's scale
    stall_kinds: tuple[str, ...] = STALL_KINDS


class Driver:
    def __init__(
        self, cluster: ChaosCluster, schedule: Schedule, hitl_turns: list[Turn], seed: int
    ) -> None:
        self.cluster = cluster
        self.schedule = schedule
        self.hitl_turns = hitl_turns
        self.rng = random.Random(seed)
        self.hitl_gate = asyncio.Event()  # set once the prompts may be answered
        self.prompts_out = asyncio.Event()
        self.full_restarts = 0
        self.hitl_across_restart = 0
        self.redis_crashes = 0
        self.errors: list[str] = []
        self.timeline: list[str] = []
        self._seen_prompts = 0
        self._t0 = time.monotonic()
        self._stall: asyncio.Task[None] | None = None
        self._next_stall = 0.0

    def on_hitl(self, _turn: Turn) -> None:
        self._seen_prompts += 1
        if self._seen_prompts >= len(self.hitl_turns):
            self.prompts_out.set()

    def note(self, what: str) -> None:
        self.timeline.append(f"{time.monotonic() - self._t0:6.1f}s {what}")

    async def run(self, done: asyncio.Event, t0: float) -> None:
        s, rng = self.schedule, self.rng
        self._t0 = t0
        every = {"worker": s.worker_every, "runner": s.runner_every, "gateway": s.gateway_every}
        next_kill = {kind: t0 + rng.uniform(*span) for kind, span in every.items()}
        redis_at = [t0 + at for at in s.redis_crashes_at]
        if s.stall_every is not None:
            self._next_stall = t0 + rng.uniform(*s.stall_every)
        try:
            while not done.is_set() and time.monotonic() < t0 + s.seconds:
                now = time.monotonic()
                await self.supervise()
                if not self.hitl_gate.is_set() and now > t0 + s.full_restart_window[0]:
                    if self.prompts_out.is_set() or now > t0 + s.full_restart_window[1]:
                        await self._end_stall()
                        await self._full_restart()
                        continue
                if redis_at and now >= redis_at[0]:
                    redis_at.pop(0)
                    await self._end_stall()  # not stopped and restarted at once
                    self.note("Redis: kill -9")
                    await self._act(self.cluster.restart_redis, rng.uniform(*s.redis_outage))
                    self.redis_crashes += 1
                    self.note("Redis: restarted")
                    continue
                for kind, at in next_kill.items():
                    if now >= at:
                        if await self._act(self.cluster.kill_and_replace, kind):
                            self.note(f"SIGKILL a {kind}")
                        next_kill[kind] = time.monotonic() + rng.uniform(*every[kind])
                        break
                self._maybe_stall(now)
                await asyncio.sleep(0.1)
        finally:
            await self._end_stall()
            self.hitl_gate.set()

    def _maybe_stall(self, now: float) -> None:
        s = self.schedule
        if s.stall_every is None or now < self._next_stall:
            return
        if self._stall is not None and not self._stall.done():
            return
        kind = self.rng.choice(s.stall_kinds)
        seconds = self.rng.uniform(*s.stall_seconds) * time_scale()
        self._stall = asyncio.create_task(self._stall_one(kind, seconds))

    async def _stall_one(self, kind: str, seconds: float) -> None:
        pid = self.cluster.stall(kind)
        if pid is None:
            self._next_stall = time.monotonic() + 1.0
            return
        name = self.cluster.stopped_name(pid)
        self.note(f"SIGSTOP {name} for {seconds:.1f}s")
        try:
            await asyncio.sleep(seconds)  # the fault itself: how long it stays stopped
        finally:
            self.cluster.wake(pid)
            self.note(f"SIGCONT {name} (unless killed meanwhile)")
            assert self.schedule.stall_every is not None
            self._next_stall = time.monotonic() + self.rng.uniform(*self.schedule.stall_every)

    async def _end_stall(self) -> None:
        """End the stall under way, if any (its process woken at once)."""
        if self._stall is not None and not self._stall.done():
            self._stall.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stall
        self.cluster.wake()

    async def _full_restart(self) -> None:
        self.hitl_across_restart = sum(
            1 for t in self.hitl_turns if t.hitl_request_id and not t.hitl_answered
        )
        self.note(f"full restart: SIGKILL everything ({self.hitl_across_restart} prompts open)")
        await self._act(self.cluster.full_restart)
        self.full_restarts += 1
        self.note("full restart: everything up again")
        self.hitl_gate.set()

    async def supervise(self) -> None:
        """Restart what exited on its own; keep the intended number of each kind."""
        for crash in await self.cluster.replace_crashed():
            self.note(f"exited on its own, restarted: {crash}")
        for kind, count in self.schedule.counts.items():
            for _ in range(count - len(self.cluster.of(kind))):
                await self._act(self.cluster.start, kind, wait=False)

    async def _act(self, action: Callable[..., Awaitable[Any]], *args: Any, **kw: Any) -> Any:
        try:
            return await action(*args, **kw)
        except RuntimeError as exc:  # a process that would not start: supervise() retries
            self.errors.append(str(exc))
            return None
