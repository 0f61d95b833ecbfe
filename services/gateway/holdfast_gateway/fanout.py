"""One tailing loop per gateway process, fanning events out to SSE clients.

The :class:`Hub` keeps one cursor per task that has at least one connected
client and reads all of them with a single blocking ``XREAD`` — never one
blocking read per client. New events go to every subscriber's queue in
memory. A per-gateway wake stream is part of every ``XREAD``, so a client
subscribing to a task the tailer is not yet following is picked up at once
instead of after the block timeout.

Subscribers may see an event twice (live delivery overlapping their own
catch-up read) or notice a gap (a slow consumer whose queue overflowed);
:func:`holdfast_gateway.sse.event_frames` handles both by seq.
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

log = logging.getLogger(__name__)

_BLOCK_MS = 5000
_READ_COUNT = 1000
# A subscriber this many batches behind is dropped from live delivery and
# catches up from the log instead, so one slow client never grows memory.
_QUEUE_BATCHES = 256


@dataclass(eq=False)
class Subscription:
    task_id: str
    queue: asyncio.Queue[list[LoggedEvent] | None] = field(
        default_factory=lambda: asyncio.Queue(_QUEUE_BATCHES)
    )
    overflowed: bool = False


@dataclass
class _Tail:
    cursor: int
    subscribers: set[Subscription] = field(default_factory=set)


class Hub:
    def __init__(self, redis: Redis, keys: Keys, eventlog: EventLog) -> None:
        self.redis = redis
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
        }

    async def close(self) -> None:
        """After :meth:`run` stopped: end every open stream and drop the wake stream."""
        for tail in self._tails.values():
            for sub in tail.subscribers:
                sub.queue.put_nowait(None)
        await self.redis.delete(self._wake_key)

    async def subscribe(self, task_id: str) -> Subscription:
        """Start live delivery of the task's events after its current last seq."""
        sub = Subscription(task_id)
        tail = self._tails.get(task_id)
        if tail is None:
            last = await self.eventlog.last_hot_seq(task_id) or 0
            tail = self._tails.get(task_id)  # another subscriber may have won the race
            if tail is None:
                tail = self._tails[task_id] = _Tail(cursor=last)
                self._key_to_task[self.keys.events(task_id)] = task_id
                tail.subscribers.add(sub)
                await self.redis.xadd(self._wake_key, {"t": task_id}, maxlen=100)
                return sub
        tail.subscribers.add(sub)
        return sub

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
            task_id = self._key_to_task.get(key)
            tail = self._tails.get(task_id) if task_id else None
            if tail is None:
                continue  # every subscriber left while we were reading
            events = [LoggedEvent(int(eid.split("-", 1)[0]), f["t"], f["d"]) for eid, f in entries]
            tail.cursor = events[-1].seq
            for sub in tail.subscribers:
                if sub.overflowed:
                    continue
                try:
                    sub.queue.put_nowait(events)
                except asyncio.QueueFull:
                    sub.overflowed = True
