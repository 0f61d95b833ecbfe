"""Consume turn jobs from ``Keys.turns`` through the ``loop-workers`` group.

Each job runs as its own asyncio task, up to ``worker_concurrency`` at once;
a job is acknowledged only after its turn reached a terminal event and the
task's turn lock was released.
"""

from __future__ import annotations

import asyncio
import logging

from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import TURNS_GROUP, Keys
from holdfast_shared.turnlock import TurnLock
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from holdfast_loop_worker.turn import TurnContext, TurnRunner

log = logging.getLogger(__name__)


async def ensure_group(redis: Redis, stream: str, group: str) -> None:
    try:
        # "0": jobs enqueued before the first worker ever started still run.
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class TurnConsumer:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        ctx: TurnContext,
        lock: TurnLock,
        *,
        consumer_name: str,
        concurrency: int,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.ctx = ctx
        self.lock = lock
        self.consumer_name = consumer_name
        self.concurrency = concurrency
        self._running: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Take jobs until ``stop`` is set, then wait for the turns in flight."""
        await ensure_group(self.redis, self.keys.turns, TURNS_GROUP)
        stop_wait = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                free = self.concurrency - len(self._running)
                if free <= 0:
                    await asyncio.wait(
                        [stop_wait, *self._running], return_when=asyncio.FIRST_COMPLETED
                    )
                    continue
                read = asyncio.create_task(
                    self.redis.xreadgroup(
                        TURNS_GROUP,
                        self.consumer_name,
                        {self.keys.turns: ">"},
                        count=free,
                        block=1000,
                    )
                )
                await asyncio.wait([read, stop_wait], return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    # Stopping: the read may still hand us jobs; they stay
                    # pending in the group for another worker if we drop them,
                    # so cancel only after it returns.
                    response = await read
                else:
                    response = read.result()
                for _stream, entries in response or []:
                    for entry_id, fields in entries:
                        self._start(entry_id, fields)
        finally:
            stop_wait.cancel()
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)

    def _start(self, entry_id: str, fields: dict[str, str]) -> None:
        task = asyncio.create_task(self._handle(entry_id, fields), name=f"turn:{entry_id}")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _handle(self, entry_id: str, fields: dict[str, str]) -> None:
        try:
            job = TurnJob.from_fields(fields)
        except ValueError:
            log.error("dropping malformed turn job %s: %r", entry_id, fields)
            await self.redis.xack(self.keys.turns, TURNS_GROUP, entry_id)
            return
        try:
            status = await TurnRunner(self.ctx, job).run()
            log.info("turn %s of task %s %s", job.turn_id, job.task_id, status)
            await self.lock.release(job.task_id, job.turn_id)
            await self.redis.xack(self.keys.turns, TURNS_GROUP, entry_id)
        except Exception:
            # Left unacknowledged: the job stays pending for recovery.
            log.exception("turn %s could not be finished", job.turn_id)
