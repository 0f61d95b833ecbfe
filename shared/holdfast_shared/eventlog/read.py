"""Reading a task's event log: the hot copy in Redis, the cold one in PostgreSQL,
and the two stitched together in order."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy import func, select

from holdfast_shared.db.models import EventRecord
from holdfast_shared.eventlog.base import LogBase
from holdfast_shared.eventlog.records import LoggedEvent, seq_of


class Reading(LogBase):
    """Reads task event logs."""

    async def read_hot(self, task_id: str, after_seq: int, count: int = 1000) -> list[LoggedEvent]:
        """Events after ``after_seq`` from the Redis copy (possibly fewer than exist)."""
        entries = await self.redis.xrange(
            self.keys.events(task_id), min=f"{after_seq + 1}-0", max="+", count=count
        )
        return [LoggedEvent(seq_of(eid), f["t"], f["d"]) for eid, f in entries]

    async def first_hot_seq(self, task_id: str) -> int | None:
        entries = await self.redis.xrange(self.keys.events(task_id), count=1)
        return seq_of(entries[0][0]) if entries else None

    async def last_hot_seq(self, task_id: str) -> int | None:
        entries = await self.redis.xrevrange(self.keys.events(task_id), count=1)
        return seq_of(entries[0][0]) if entries else None

    async def read_cold(
        self, task_id: str, after_seq: int, before_seq: int | None, limit: int = 1000
    ) -> list[LoggedEvent]:
        """Events from PostgreSQL with ``after_seq < seq < before_seq``."""
        query = (
            select(EventRecord.seq, EventRecord.type, EventRecord.data)
            .where(EventRecord.task_id == task_id, EventRecord.seq > after_seq)
            .order_by(EventRecord.seq)
            .limit(limit)
        )
        if before_seq is not None:
            query = query.where(EventRecord.seq < before_seq)
        async with self.sessions() as session:
            rows = (await session.execute(query)).all()
        return [LoggedEvent(int(r[0]), r[1], r[2]) for r in rows]

    async def pages_after(
        self, task_id: str, after_seq: int, page_size: int = 1000
    ) -> AsyncIterator[list[LoggedEvent]]:
        """Every stored event after ``after_seq``, in order, in pages.

        Older events come from PostgreSQL, the rest from Redis; the pages end
        at the newest event at the time the last page was read.
        """
        cursor = after_seq
        first_hot = await self.first_hot_seq(task_id)
        if first_hot is None or first_hot > cursor + 1:
            while True:
                page = await self.read_cold(task_id, cursor, first_hot, page_size)
                if page:
                    yield page
                    cursor = page[-1].seq
                if len(page) < page_size:
                    break
        while True:
            page = await self.read_hot(task_id, cursor, page_size)
            if page:
                yield page
                cursor = page[-1].seq
            if len(page) < page_size:
                break

    async def seq_at_timestamp(self, task_id: str, timestamp: int) -> int:
        """The highest seq whose timestamp is ``<= timestamp`` (0 if none).

        Seq and timestamp rise together, so this turns a timestamp cursor into
        an exact seq cursor: a binary search over the hot stream, or an index
        look-up in PostgreSQL for older events.
        """
        if timestamp <= 0:
            return 0
        key = self.keys.events(task_id)
        first = await self.redis.xrange(key, count=1)
        if first and int(first[0][1]["ts"]) <= timestamp:
            low = seq_of(first[0][0])
            last = await self.redis.xrevrange(key, count=1)
            high = seq_of(last[0][0])
            # Seqs in the stream are contiguous, so seq ``mid`` is entry ``mid-0``.
            # Invariant: ts(low) <= timestamp; find the last such seq.
            while low < high:
                mid = (low + high + 1) // 2
                entry = await self.redis.xrange(key, min=f"{mid}-0", max=f"{mid}-0")
                if entry and int(entry[0][1]["ts"]) <= timestamp:
                    low = mid
                else:
                    high = mid - 1
            return low
        async with self.sessions() as session:
            value = await session.scalar(
                select(func.max(EventRecord.seq)).where(
                    EventRecord.task_id == task_id, EventRecord.timestamp <= timestamp
                )
            )
        return int(value or 0)
