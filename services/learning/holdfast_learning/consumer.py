"""The learning centre's intake: trajectory announcements, read in batches.

Reads ``Keys.trajectories`` through the ``LEARNING_GROUP`` consumer group. A
batch is what arrives within ``HOLDFAST_LEARNING_BATCH_WINDOW_SECONDS`` of
its first entry, up to ``HOLDFAST_LEARNING_BATCH_SIZE`` entries; it is
learned, then acknowledged. Entries a dead learner read but never
acknowledged are claimed (``XAUTOCLAIM``) once idle for
``HOLDFAST_LEARNING_CLAIM_IDLE_SECONDS``, so a learner killed mid-batch
loses nothing; learning is idempotent by trajectory id, so nothing is
learned twice either.

The stream only announces: the trajectory is in PostgreSQL, and the sweep
(``missed_sweep.py``) learns any whose announcement was lost — Redis losing the
stream and its group too: the group is created again (``holdfast_shared.consuming``
reads, takes over and acknowledges; the batching is this module's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from holdfast_shared.consuming import Delivery, GroupConsumer, RedisUnavailable, is_nogroup
from holdfast_shared.jobs import TrajectoryReady
from holdfast_shared.keys import LEARNING_GROUP, Keys
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from holdfast_learning.learner import Learner

log = logging.getLogger(__name__)

# How long one blocking read waits for the first entry of a batch.
_IDLE_BLOCK_MS = 5000
# The liveness key outlives a blocking read (refreshed every third of this).
_ALIVE_TTL_SECONDS = 20


@dataclass(frozen=True, slots=True)
class BatchSettings:
    size: int
    window_seconds: float
    claim_idle_seconds: float


class TrajectoryConsumer:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        learner: Learner,
        settings: BatchSettings,
        *,
        name: str,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.learner = learner
        self.settings = settings
        self.name = name
        self.group = GroupConsumer(
            redis,
            keys.trajectories,
            LEARNING_GROUP,
            name,
            claim_idle_ms=int(settings.claim_idle_seconds * 1000),
        )
        self._last_claim = 0.0
        self._last_alive = -float(_ALIVE_TTL_SECONDS)
        # Totals since start (logged; /learning/status reads the table instead).
        self.learned = 0
        self.batches = 0

    async def run(self) -> None:
        """Learn batches until cancelled (by ``main.learning_centre`` as the process
        stops: a batch cut short stays pending, and is taken over)."""
        await self.group.ensure_group()
        delay = 0.2
        while True:
            try:
                await self._alive()
                await self.step()
                delay = 0.2
            except ResponseError as exc:
                if not is_nogroup(exc):
                    raise
                # Redis lost its data: what it announced is in PostgreSQL, for the sweep.
                log.warning("the learning group is gone (Redis lost its data?); recreating it")
                await self.group.ensure_group()
            except RedisUnavailable:
                log.warning("Redis unreachable; the learning intake retries in %.1fs", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _alive(self) -> None:
        """Say this learner consumes (readiness, and what /health lists)."""
        now = time.monotonic()
        if now - self._last_alive >= _ALIVE_TTL_SECONDS / 3:
            self._last_alive = now
            await self.redis.set(self.keys.learner_alive(self.name), "1", ex=_ALIVE_TTL_SECONDS)

    async def step(self) -> int:
        """Read one batch, learn it, acknowledge it; returns its size."""
        entries = await self._claim_stale()
        # Entries taken over are due already: wait only the window for more.
        entries += await self._read(self.settings.size - len(entries), started=bool(entries))
        if not entries:
            return 0
        ids: list[str] = []
        for entry in entries:
            try:
                ids.append(TrajectoryReady.from_fields(entry.fields).trajectory_id)
            except ValueError:
                # Its field names, not their values: whatever wrote them may have
                # put content there.
                log.error(
                    "dropping a malformed trajectory announcement %s (fields: %s)",
                    entry.entry_id,
                    sorted(entry.fields),
                )
        result = await self.learner.learn(ids)
        await self.group.ack(*(entry.entry_id for entry in entries))
        self.learned += result.learned
        self.batches += 1
        log.debug(
            "learned %d, skipped %d, failed %d, dead %d of a batch of %d",
            result.learned,
            result.skipped,
            result.failed,
            result.dead,
            len(entries),
        )
        return len(entries)

    async def _read(self, want: int, *, started: bool) -> list[Delivery]:
        """Up to ``want`` new entries: block until the first (unless the batch
        has ``started``), then take what arrives within the window."""
        got: list[Delivery] = []
        deadline = time.monotonic() + self.settings.window_seconds if started else None
        while len(got) < want:
            block: int
            if deadline is None:
                block = _IDLE_BLOCK_MS
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                block = max(1, int(left * 1000))
            entries = await self.group.read_new(want - len(got), block_ms=block)
            if not entries and deadline is None:
                return got  # idle: let the caller claim stale entries, then wait again
            if entries and deadline is None:
                deadline = time.monotonic() + self.settings.window_seconds
            got.extend(entries)
        return got

    async def _claim_stale(self) -> list[Delivery]:
        now = time.monotonic()
        if now - self._last_claim < self.settings.claim_idle_seconds / 2:
            return []
        self._last_claim = now
        claimed = await self.group.take_over(self.settings.size)
        if claimed:
            log.info("took over %d trajectory announcements a stopped learner left", len(claimed))
        return claimed
