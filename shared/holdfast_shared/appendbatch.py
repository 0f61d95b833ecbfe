"""Appends from every turn of a process, sent to Redis together.

A loop-worker streams many turns at once, and each delta is an append: one
EVALSHA of the append script and a ZINCRBY of the archiver's dirty set. Sent
one pipeline per append, most of a streaming worker's time went to redis-py's
per-pipeline work (a connection checkout with its health check, packing, a
send and a read) rather than to Redis. :class:`AppendBatcher` queues the
appends and one flusher task sends whatever is queued as one pipeline, so the
appends that become ready while a pipeline is on the wire share the next one.
A lone append waits for nothing: the flusher starts at once and sends it
alone. Under load, batches grow by themselves (the ioredis "auto-pipelining"
idea), and so the work per append shrinks just when it matters.

What an append keeps: its own reply (or error), its order among the appends
of the same task (a FIFO queue, pipelines in order on one connection, one
pipeline at a time), and "not written" when its caller was cancelled before
its pipeline was sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

log = logging.getLogger(__name__)

# Bounds one pipeline (and so the reply a client must buffer); the rest of the
# queue goes in the next one.
MAX_BATCH = 256


@dataclass(slots=True)
class _Append:
    keys: Sequence[str]
    args: Sequence[str]
    task_id: str
    future: asyncio.Future[tuple[list[int], int | None]] = field(repr=False)


class AppendBatcher:
    """Sends queued calls of one script, each followed by a dirty mark of its task,
    as one pipeline at a time; ``WAIT`` once per pipeline when replicas must ack."""

    def __init__(
        self,
        redis: Redis,
        script: str,
        sha: str,
        dirty_key: str,
        *,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
    ) -> None:
        self.redis = redis
        self.script = script
        self.sha = sha
        self.dirty_key = dirty_key
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._queue: list[_Append] = []
        self._flusher: asyncio.Task[None] | None = None
        # For tests and the bench: pipelines sent, appends in them.
        self.pipelines = 0
        self.appends = 0

    async def call(
        self, keys: Sequence[str], task_id: str, args: Sequence[str]
    ) -> tuple[list[int], int | None]:
        """The script's reply for this call, and how many replicas acknowledged its
        pipeline (``None`` without ``wait_replicas``)."""
        loop = asyncio.get_running_loop()
        if self._flusher is not None and self._flusher.get_loop() is not loop:
            # Left by a loop that closed mid-flush: its calls went with it.
            self._queue = [i for i in self._queue if i.future.get_loop() is loop]
            self._flusher = None
        item = _Append(keys, args, task_id, loop.create_future())
        self._queue.append(item)
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush(), name="append-batcher")
        return await item.future

    async def _flush(self) -> None:
        try:
            while self._queue:
                # Calls cancelled while queued are dropped: they were never sent.
                live = [item for item in self._queue if not item.future.done()]
                batch, self._queue = live[:MAX_BATCH], live[MAX_BATCH:]
                if batch:
                    await self._send(batch)
        except BaseException as exc:  # the loop is closing: nothing queued is sent
            queued, self._queue = self._queue, []
            _fail(queued, exc)
            raise
        finally:
            self._flusher = None

    async def _send(self, batch: list[_Append]) -> None:
        try:
            replies, acked = await self._pipeline(batch)
            if any(isinstance(reply, NoScriptError) for reply in replies):
                # A restarted or flushed Redis: every call of the pipeline failed
                # alike (their marks alone are harmless). Load it and send again.
                await self.redis.script_load(self.script)
                replies, acked = await self._pipeline(batch)
        except BaseException as exc:
            _fail(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        self.pipelines += 1
        self.appends += len(batch)
        for item, reply in zip(batch, replies, strict=True):
            if item.future.done():
                continue  # its caller left while the pipeline was on the wire
            if isinstance(reply, Exception):
                item.future.set_exception(reply)
            else:
                item.future.set_result((list(reply), acked))

    async def _pipeline(self, batch: list[_Append]) -> tuple[list[Any], int | None]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for item in batch:
                pipe.evalsha(self.sha, len(item.keys), *item.keys, *item.args)
            # Marked after the appends, so the archiver never clears a mark for
            # an entry it has not seen (see EventLog.archive_task).
            for task_id in dict.fromkeys(item.task_id for item in batch):
                pipe.zincrby(self.dirty_key, 1, task_id)
            if self.wait_replicas:
                # Same connection as the appends: WAIT counts the replicas that have them.
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            replies = list(await pipe.execute(raise_on_error=False))
        acked = None
        if self.wait_replicas:
            wait = replies[-1]
            if isinstance(wait, Exception):
                raise wait
            acked = int(wait)
        return replies[: len(batch)], acked


def _fail(items: list[_Append], exc: BaseException) -> None:
    for item in items:
        if item.future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            item.future.cancel()  # the flusher was cancelled: so are its calls
        else:
            item.future.set_exception(exc)


async def eval_many(
    redis: Redis,
    script: str,
    sha: str,
    calls: Sequence[tuple[Sequence[Any], Sequence[Any]]],
    *,
    raise_on_error: bool = True,
) -> list[Any]:
    """Each ``(keys, args)`` call of one script, in one pipeline; their replies in order.

    Loads the script and sends them all again when Redis lacks it (then none ran).
    Any other error of a call is raised after the pipeline, as redis-py does, or
    (``raise_on_error=False``) left in its place among the replies.
    """

    async def send() -> list[Any]:
        async with redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.evalsha(sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    if not calls:
        return []
    replies = await send()
    if any(isinstance(reply, NoScriptError) for reply in replies):
        await redis.script_load(script)
        replies = await send()
    for reply in replies:
        if isinstance(reply, Exception) and raise_on_error:
            raise reply
    return replies
