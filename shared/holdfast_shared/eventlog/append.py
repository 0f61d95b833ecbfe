"""Appending to a task's event log: one script call, all events or none.

The script (``lua/append.lua``) assigns each event its seq and timestamp and
writes its envelope; when the stream is gone the next seq continues from
PostgreSQL. An append may be fenced by the turn's epoch (:func:`next_epoch`).

Appends from every turn of a process are sent to Redis together. A
loop-worker streams many turns at once, and each delta is an append: one
EVALSHA of the append script and a ZINCRBY of the archiver's dirty set. Sent
one pipeline per append, most of a streaming worker's time went to redis-py's
per-pipeline work (a connection checkout with its health check, packing, a
send and a read) rather than to Redis. :class:`AppendBatcher` queues the
appends and one flusher task sends whatever is queued as one pipeline, so the
appends that become ready while a pipeline is on the wire share the next one.
A lone append waits for nothing: the flusher starts at once and sends it
alone. Under load, batches grow by themselves (the ioredis "auto-pipelining"
idea), and so the work per append shrinks just when it matters. What an
append keeps: its own reply (or error), its order among the appends of the
same task (a FIFO queue, pipelines in order on one connection, one pipeline
at a time), and "not written" when its caller was cancelled before its
pipeline was sent.

A running turn appends through its :class:`Emitter`, which coalesces the
turn's events into as few appends as it can: ``emit`` never waits for Redis
while a write is already in flight, events queue up and go out together in
the next append, so a fast model stream costs one round trip per batch
instead of one per delta, and the first event of a quiet stream still leaves
at once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import NoScriptError
from sqlalchemy import func, select

from holdfast_shared.db.models import EventRecord
from holdfast_shared.errors import Superseded
from holdfast_shared.eventlog.base import LogBase
from holdfast_shared.eventlog.records import Appended
from holdfast_shared.eventlog.scripts import APPEND
from holdfast_shared.events import _Event, body_json
from holdfast_shared.keys import Keys
from holdfast_shared.observability import metrics
from holdfast_shared.redisconn import ClusterClient

log = logging.getLogger(__name__)

# Bounds one pipeline of the AppendBatcher (and so the reply a client must
# buffer); the rest of the queue goes in the next one.
MAX_BATCH = 256
# Past this many events queued in an Emitter, emit() waits for the writer (backpressure).
_HIGH_WATER = 2000


async def next_epoch(redis: Redis, keys: Keys, task_id: str) -> int:
    """Start a new epoch for the task's turn: writers of older epochs are fenced off."""
    return int(await redis.incr(keys.turn_epoch(task_id)))


class Appending(LogBase):
    """Appends to task event logs."""

    @cached_property
    def _batcher(self) -> AppendBatcher:
        # Made here, not in LogBase.__init__ with the rest: base.py cannot import
        # this module, which imports it.
        return AppendBatcher(
            self.redis,
            APPEND,
            self._append.sha,
            self.keys.archive_dirty,
            wait_replicas=self.wait_replicas,
            wait_timeout_ms=self.wait_timeout_ms,
        )

    async def append(
        self,
        task_id: str,
        turn_id: str | None,
        events: Sequence[_Event],
        *,
        name: str,
        new_task: bool = False,
    ) -> Appended:
        """Append events in order; all or none land (one script call).

        ``task_id`` is the engine's id of the task (its keys); ``name`` is the
        client's name for it, which the events carry as their ``task_id``.
        ``new_task`` says the task has no history, which saves a PostgreSQL
        look-up when its stream does not exist yet.
        """
        return await self.append_bodies(
            task_id,
            turn_id,
            [(e.type, body_json(e)) for e in events],
            name=name,
            new_task=new_task,
        )

    async def append_bodies(
        self,
        task_id: str,
        turn_id: str | None,
        bodies: Sequence[tuple[str, str]],
        *,
        name: str,
        new_task: bool = False,
        release_lock: bool = False,
        epoch: int | None = None,
    ) -> Appended:
        """Like :meth:`append`, for callers that serialised the bodies already.

        ``release_lock`` frees the task's turn lock (if ``turn_id`` holds it) in
        the same atomic step as the append: the terminal event of a turn and
        the task becoming free for its next message are one moment.
        ``epoch`` fences a turn's writer: the append is refused with
        :class:`Superseded` once the turn's epoch moved on (another worker
        took it over while this one stalled).
        """
        if not bodies:
            raise ValueError("nothing to append")
        flat: list[str] = []
        for event_type, body in bodies:
            flat += (event_type, body)
        floor: tuple[str, str] = ("0", "0") if new_task else ("", "")
        keys = [
            self.keys.events(task_id),
            self.keys.archived(task_id),
            self.keys.running_turn(task_id),
            self.keys.turn_epoch(task_id),
        ]
        release = "1" if release_lock else ""
        fence = "" if epoch is None else str(epoch)
        while True:
            result = await self._call_append(
                keys, task_id, name, turn_id, (*floor, release, fence), flat
            )
            if result[0] == -2:
                raise Superseded(f"turn {turn_id} of task {task_id} was taken over")
            if result[0] != -1:
                metrics.events_appended(bodies)
                return Appended(int(result[0]), tuple(int(ts) for ts in result[1:]))
            seq, ts = await self._pg_floor(task_id)
            floor = (str(seq), str(ts))

    async def _call_append(
        self,
        keys: list[str],
        task_id: str,
        name: str,
        turn_id: str | None,
        head: tuple[str, str, str, str],
        flat: list[str],
    ) -> list[int]:
        if self._cluster is not None:
            # A failover can cut the reply of an append that landed and reached the
            # replica; the token lets its retry find it instead of appending twice.
            token = secrets.token_hex(8)
            return await self._call_append_cluster(
                self._cluster, keys, task_id, [name, turn_id or "", *head, token], flat
            )
        args = [name, turn_id or "", *head, "", "", *flat]
        # The append and its task's dirty mark, in a pipeline shared with the
        # other turns' appends of this moment (AppendBatcher).
        result, acked = await self._batcher.call(keys, task_id, args)
        if acked is not None:
            self._check_replicas(result, [acked])
        return result

    async def _call_append_cluster(
        self,
        cluster: ClusterClient,
        keys: list[str],
        task_id: str,
        head: list[str],
        flat: list[str],
    ) -> list[int]:
        # The dirty set lives in another slot (maybe on another node), where one
        # pipeline would not keep the order that the archiver relies on: the
        # append first, then the mark, one after the other.
        attempts = 0

        def build(pipe: Any) -> None:
            # Every attempt after the first may follow one that landed.
            nonlocal attempts
            retry = "1" if attempts else ""
            attempts += 1
            pipe.evalsha(self._append.sha, len(keys), *keys, *head, retry, *flat)
            if self.wait_replicas:
                pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms)

        try:
            result, *rest = await cluster.on_master(keys[0], build)
        except NoScriptError:
            await cluster.script_load(APPEND)
            result, *rest = await cluster.on_master(keys[0], build)
        if self.wait_replicas:
            self._check_replicas(result, rest)
        await self.redis.zincrby(self.keys.archive_dirty, 1, task_id)
        return list(result)

    def _check_replicas(self, result: list[int], rest: list[Any]) -> None:
        if not self.wait_replicas or result[0] < 0:
            return
        acked = int(rest[-1])
        if acked < self.wait_replicas:
            # Appended and kept by the master; a failover before a replica has it
            # loses it. min-replicas-to-write is what refuses such a write outright.
            log.warning(
                "an append reached %d of %d replicas within %d ms",
                acked,
                self.wait_replicas,
                self.wait_timeout_ms,
            )

    async def _pg_floor(self, task_id: str) -> tuple[int, int]:
        async with self.sessions() as session:
            row = (
                await session.execute(
                    select(
                        func.coalesce(func.max(EventRecord.seq), 0),
                        func.coalesce(func.max(EventRecord.timestamp), 0),
                    ).where(EventRecord.task_id == task_id)
                )
            ).one()
        return int(row[0]), int(row[1])


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


class Emitter:
    """One turn's appends to its task's log, coalesced (see the module's docstring)."""

    def __init__(self, eventlog: Appending, task_id: str, turn_id: str) -> None:
        self._log = eventlog
        # Set when the turn is claimed; appends of a superseded epoch are refused.
        self.epoch: int | None = None
        # The client's name for the task, which its events carry; set with the
        # epoch, from the task's row.
        self.task_name = task_id
        self._task_id = task_id
        self._turn_id = turn_id
        self._pending: list[tuple[str, str]] = []
        self._writer: asyncio.Task[None] | None = None
        self.last_seq = 0

    async def emit(self, event: _Event) -> None:
        await self.emit_body(event.type, body_json(event))

    async def emit_body(self, event_type: str, body: str) -> None:
        """Emit an event already serialised (``body_json``'s form: no envelope)."""
        self._pending.append((event_type, body))
        if self._writer is None or self._writer.done():
            if self._writer is not None:
                self._writer.result()  # surface a failed write now
            self._writer = asyncio.create_task(self._write(), name=f"emit:{self._task_id}")
        elif len(self._pending) >= _HIGH_WATER:
            await asyncio.shield(self._writer)

    async def drain(self) -> int:
        """Wait until every emitted event is in the log; returns the last seq."""
        while self._writer is not None:
            writer = self._writer
            await writer
            if self._writer is writer:
                self._writer = None
        return self.last_seq

    async def finish(self, events: list[_Event]) -> int:
        """Append the turn's last events and free the task in one atomic step."""
        await self.drain()
        bodies = [(event.type, body_json(event)) for event in events]
        appended = await self._log.append_bodies(
            self._task_id,
            self._turn_id,
            bodies,
            name=self.task_name,
            release_lock=True,
            epoch=self.epoch,
        )
        self.last_seq = appended.last_seq
        return self.last_seq

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            appended = await self._log.append_bodies(
                self._task_id, self._turn_id, batch, name=self.task_name, epoch=self.epoch
            )
            self.last_seq = appended.last_seq
