"""The chaos driver: kills and restarts processes on a schedule while the load runs.

One action at a time, on a clock: a loop-worker every few seconds, a
tool-runner and a gateway now and then (each replaced at once, the
replacement not waited for), Redis crashed (``kill -9``) and restarted at
fixed moments, and one full restart — every engine process and Redis
SIGKILLed together — once the HITL prompts are out. Processes that exit on
their own are restarted, as ``holdfast up`` or compose would, and counted.
Bounded: it stops when the load is done or its time is up.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tests.chaos.client import Turn
from tests.chaos.cluster import ChaosCluster


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
        try:
            while not done.is_set() and time.monotonic() < t0 + s.seconds:
                now = time.monotonic()
                await self.supervise()
                if not self.hitl_gate.is_set() and now > t0 + s.full_restart_window[0]:
                    if self.prompts_out.is_set() or now > t0 + s.full_restart_window[1]:
                        await self._full_restart()
                        continue
                if redis_at and now >= redis_at[0]:
                    redis_at.pop(0)
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
                await asyncio.sleep(0.1)
        finally:
            self.hitl_gate.set()

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
