"""One tailing loop per gateway process, fanning events out to SSE clients.

The :class:`Hub` keeps one cursor per task that has at least one connected
client and reads all of them with a single blocking ``XREAD`` — never one
blocking read per client. New events go to every subscriber's queue in
memory. A per-gateway wake stream is part of every ``XREAD``, so a client
subscribing to a task the tailer is not yet following is picked up at once
instead of after the block timeout.

Subscribers may see an event twice (live delivery overlapping their own
catch-up read) or notice a gap (a slow consumer whose queue overflowed);
:func:`holdfast_gateway.sse.event_frames` handles both by seq. A queue holds at
most ``max_buffered_events`` events (and ``max_buffered_bytes`` of them): past
that its subscriber gets no more, and the SSE response it serves is dropped
(``slowreader.py``; the client resumes from its cursor).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import NoReturn

from holdfast_shared.eventlog import EventLog, LoggedEvent
from holdfast_shared.keys import Keys
from redis.asyncio import Redis
from redis.typing import KeyT, StreamIdT

from holdfast_gateway import slowreader

log = logging.getLogger(__name__)

_BLOCK_MS = 5000
_READ_COUNT = 1000


class Buffered:
    """A subscriber's batches, counting the events (and their bytes) it holds.

    One reader (the connection's frames) and one writer (the hub): a list and
    at most one waiting future, rather than an ``asyncio.Queue`` with its
    three deques and an event — on a gateway holding ten thousand idle
    streams, this is most of what a subscription costs.
    """

    __slots__ = ("_items", "_waiter", "bytes", "events")

    def __init__(self) -> None:
        self.events = 0
        self.bytes = 0
        self._items: list[list[LoggedEvent] | None] = []
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: list[LoggedEvent] | None) -> None:
        self._items.append(item)
        if item:
            self.events += len(item)
            self.bytes += sum(len(e.data) for e in item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> list[LoggedEvent] | None:
        """The next batch (``None``: the gateway is shutting down)."""
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        item = self._items.pop(0)
        if item:
            self.events -= len(item)
            self.bytes -= sum(len(e.data) for e in item)
        return item


@dataclass(eq=False, slots=True)
class Subscription:
    task_id: str
    queue: Buffered = field(default_factory=Buffered)
    # No more live delivery until the subscriber caught up from the log.
    overflowed: bool = False
    # The SSE response this feeds, dropped once the queue is past its bounds.
    guard: slowreader.Guard | None = None


@dataclass
class _Tail:
    cursor: int
    subscribers: set[Subscription] = field(default_factory=set)


class Hub:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        eventlog: EventLog,
        *,
        max_buffered_events: int = 10_000,
        max_buffered_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self.redis = redis
        self.max_buffered_events = max_buffered_events
        self.max_buffered_bytes = max_buffered_bytes
        self.dropped_slow_readers = 0
        self.keys = keys
        self.eventlog = eventlog
        self.gateway_id = uuid.uuid4().hex[:12]
        self._wake_key = keys.gateway_wake(self.gateway_id)
        self._wake_cursor = "0-0"
        self._tails: dict[str, _Tail] = {}
        self._key_to_task: dict[str, str] = {}

    @property
    def stats(self) -> dict[str, int]:
        return {
            "tasks": len(self._tails),
            "subscribers": sum(len(t.subscribers) for t in self._tails.values()),
            "slow_readers_dropped": self.dropped_slow_readers,
        }

    async def close(self) -> None:
        """After :meth:`run` stopped: end every open stream and drop the wake stream."""
        for tail in self._tails.values():
            for sub in tail.subscribers:
                sub.queue.put_nowait(None)
        await self.redis.delete(self._wake_key)

    async def subscribe(self, task_id: str) -> Subscription:
        """Start live delivery of the task's events after its current last seq."""
        sub = Subscription(task_id, guard=slowreader.current())
        tail = self._tails.get(task_id)
        if tail is None:
            last = await self.eventlog.last_hot_seq(task_id) or 0
            tail = self._tails.get(task_id)  # another subscriber may have won the race
            if tail is None:
                tail = self._tails[task_id] = _Tail(cursor=last)
                self._key_to_task[self.keys.events(task_id)] = task_id
                tail.subscribers.add(sub)
                await self._follow(task_id)
                return sub
        tail.subscribers.add(sub)
        return sub

    async def _follow(self, task_id: str) -> None:
        """Have the tailer read the newly followed task's stream from now on."""
        await self.redis.xadd(self._wake_key, {"t": task_id}, maxlen=100)

    def unsubscribe(self, sub: Subscription) -> None:
        tail = self._tails.get(sub.task_id)
        if tail is None:
            return
        tail.subscribers.discard(sub)
        if not tail.subscribers:
            del self._tails[sub.task_id]
            self._key_to_task.pop(self.keys.events(sub.task_id), None)

    async def run(self) -> NoReturn:
        """Tail the subscribed tasks' logs, for ever (run it in a ``Background``)."""
        while True:
            try:
                await self._read_once()
            except Exception:
                log.exception("event tailer read failed; retrying")
                await asyncio.sleep(0.5)

    async def _read_once(self) -> None:
        streams: dict[KeyT, StreamIdT] = {self._wake_key: self._wake_cursor}
        for followed, following in self._tails.items():
            streams[self.keys.events(followed)] = f"{following.cursor}-0"
        response = await self.redis.xread(streams, count=_READ_COUNT, block=_BLOCK_MS)
        for key, entries in response or []:
            if key == self._wake_key:
                self._wake_cursor = entries[-1][0]
                continue
            self._dispatch(key, entries)

    def _dispatch(self, key: str, entries: list[tuple[str, dict[str, str]]]) -> None:
        """Hand the entries read from the events stream ``key`` to its subscribers."""
        task_id = self._key_to_task.get(key)
        tail = self._tails.get(task_id) if task_id else None
        if tail is None:
            return  # every subscriber left while we were reading
        events = [LoggedEvent(int(eid.split("-", 1)[0]), f["t"], f["d"]) for eid, f in entries]
        tail.cursor = events[-1].seq
        size = sum(len(e.data) for e in events)
        for sub in tail.subscribers:
            if not sub.overflowed:
                self._deliver(sub, events, size)

    def _deliver(self, sub: Subscription, events: list[LoggedEvent], size: int) -> None:
        queue = sub.queue
        if (
            queue.events + len(events) <= self.max_buffered_events
            and queue.bytes + size <= self.max_buffered_bytes
        ):
            queue.put_nowait(events)
            return
        # Bounded memory: nothing more for this one. Its response is dropped (the
        # client resumes from its cursor); a subscriber without one catches up
        # from the log once it reads again.
        sub.overflowed = True
        if sub.guard is not None:
            self.dropped_slow_readers += 1
            sub.guard.trip(
                f"{queue.events} events ({queue.bytes:,} bytes) of task {sub.task_id} waiting "
                f"for it (HOLDFAST_SSE_MAX_BUFFERED_EVENTS={self.max_buffered_events}, "
                f"HOLDFAST_SSE_MAX_BUFFERED_BYTES={self.max_buffered_bytes})"
            )
