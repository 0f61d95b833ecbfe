"""The event copier: copies each task's new events from Redis to PostgreSQL.

Every append bumps the task in ``Keys.archive_dirty``; a copying pass (the
background :class:`Archiver`, or :meth:`Copying.archive_now` at a turn's
snapshot boundary) takes the task's claim, copies its events after the
watermark to the ``events`` table (idempotent on ``(task_id, seq)``), moves the
watermark, and only then lets the stream expire, ``channel_state_ttl_active``
seconds after its last copied event. A stream with uncopied events never
expires.
"""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from holdfast_shared.background import every
from holdfast_shared.eventlog.base import LogBase
from holdfast_shared.eventlog.records import seq_of
from holdfast_shared.eventlog.scripts import (
    CLAIM_AND_READ,
    CLEAR_DIRTY,
    MARK_AND_RELEASE,
    eval_many,
)
from holdfast_shared.eventlog.sql import Also, Writes, events_insert, execute_at_once, one_statement
from holdfast_shared.events import turn_of

# Longest one copying pass of a task may hold its claim, and how long a
# caller that must have the events copied waits for another copier.
_ARCHIVE_CLAIM_MS = 30_000
_CLAIM_WAIT_SECONDS = 5.0
_ARCHIVE_BATCH = 500


class Copying(LogBase):
    """Copies task event logs to PostgreSQL."""

    async def archive_task(
        self,
        task_id: str,
        dirty_score: float,
        *,
        wait: bool = False,
        also: Also | None = None,
    ) -> int:
        """Copy the task's unarchived events to PostgreSQL; returns how many.

        One archiver at a time per task (a short Redis lock): the others skip
        it instead of copying the same events again, unless ``wait`` (a caller
        that needs the events archived now waits for the other to finish,
        then copies whatever is left). ``also`` runs in the transaction that
        writes the last events, so it commits with them, or alone if there are
        none; it runs even when the claim could not be had. ``also`` may be
        :class:`Writes` instead of a callback: its statements and the last events
        then go as one SQL statement (see there).
        """
        keys = [self.keys.archiving(task_id), self.keys.archived(task_id)]
        events_key = self.keys.events(task_id)
        deadline = asyncio.get_running_loop().time() + (_CLAIM_WAIT_SECONDS if wait else 0)
        while not (
            first := await self._claim_and_read(
                keys=[*keys, events_key], args=[_ARCHIVE_CLAIM_MS, _ARCHIVE_BATCH]
            )
        ):
            if asyncio.get_running_loop().time() >= deadline:
                if also is not None:
                    await self._write([], also)
                return 0
            await asyncio.sleep(0.005)
        watermark, entries = int(first[0]), _entries(first[1])
        released = False
        try:
            copied, watermark = await self._copy(task_id, watermark, entries, also)
            await self._mark_and_release(
                keys=[events_key, keys[1], keys[0]], args=[watermark, self.hot_ttl_ms]
            )
            released = True
        finally:
            if not released:
                await self.redis.delete(keys[0])
        if dirty_score >= 0:  # the background archiver's pass; archive_now leaves the mark
            await self._clear_dirty(keys=[self.keys.archive_dirty], args=[task_id, dirty_score])
        return copied

    async def _copy(
        self,
        task_id: str,
        watermark: int,
        entries: list[tuple[str, dict[str, str]]],
        also: Also | None,
    ) -> tuple[int, int]:
        """Copy ``entries`` and the rest after them, a batch per statement; returns
        (how many, the new watermark). Holds the task's claim."""
        events_key, archived_key = self.keys.events(task_id), self.keys.archived(task_id)
        copied = 0
        while True:
            last = len(entries) < _ARCHIVE_BATCH
            rows = _rows(task_id, entries)
            if rows or (last and also is not None):
                await self._write(rows, also if last else None)
            if rows:
                watermark = seq_of(entries[-1][0])
                copied += len(rows)
            if last:
                return copied, watermark
            await self._mark_archived(
                keys=[events_key, archived_key], args=[watermark, self.hot_ttl_ms]
            )
            entries = await self.redis.xrange(
                events_key, min=f"{watermark + 1}-0", max="+", count=_ARCHIVE_BATCH
            )

    async def _write(self, rows: list[dict[str, Any]], also: Also | None) -> None:
        """Events ``rows`` and what ``also`` writes, atomically."""
        if also is None or isinstance(also, Writes):
            # One INSERT of every row (events_insert), atomic alone: where a
            # transaction took BEGIN, a statement per row (executemany) and COMMIT.
            first = [events_insert(rows)] if rows else []
            statements = [*first, *(also.statements if also is not None else ())]
            if statements:
                await execute_at_once(self.sessions.kw["bind"], one_statement(statements))
            return
        async with self.sessions.begin() as session:
            if rows:
                await session.execute(events_insert(rows))
            await also(session)

    async def archive_now(self, task_id: str, also: Also | None = None) -> int:
        """Archive the task's events right away (at a turn's snapshot boundary), and run
        ``also`` in the same transaction as the last of them (one COMMIT for both), or
        with :class:`Writes` in the same statement.

        Leaves the dirty mark for the regular archiver, which may have seen
        newer events.
        """
        # Scores start at 1: -1 never clears the mark the background archiver uses.
        return await self.archive_task(task_id, -1.0, wait=True, also=also)

    async def archive_pending(self, limit: int = 200) -> int:
        """One archiving pass over the tasks marked dirty; returns events copied."""
        dirty = await self.redis.zrange(self.keys.archive_dirty, 0, limit - 1, withscores=True)
        if self._cluster is not None:
            # A task's keys are in its own slot: one task at a time.
            copied = 0
            for task_id, score in dirty:
                copied += await self.archive_task(task_id, score)
            return copied
        return await self._archive_together(dirty) if dirty else 0

    async def _archive_together(self, dirty: list[tuple[str, float]]) -> int:
        """:meth:`archive_task` for many tasks in four round trips, not four per task:
        the claims and first batches in one pipeline, their events in one INSERT,
        the marks and releases in one pipeline. A task with more than a batch
        to copy goes on alone, holding its claim."""
        claims = await eval_many(
            self.redis,
            CLAIM_AND_READ,
            self._claim_and_read.sha,
            [
                (
                    [self.keys.archiving(t), self.keys.archived(t), self.keys.events(t)],
                    [_ARCHIVE_CLAIM_MS, _ARCHIVE_BATCH],
                )
                for t, _ in dirty
            ],
            raise_on_error=False,
        )
        if failed := [c for c in claims if isinstance(c, Exception)]:
            # Some claims were refused (a full Redis refuses the claim's SET), others
            # maybe taken: release those now, not when they lapse in 30 s.
            taken = [self.keys.archiving(t) for (t, _), c in zip(dirty, claims, strict=True)
                     if c and not isinstance(c, Exception)]  # fmt: skip
            if taken:
                await self.redis.delete(*taken)
            raise failed[0]
        # Tasks another archiver holds are left to it, their marks too.
        held = [(t, score, claim) for (t, score), claim in zip(dirty, claims, strict=True) if claim]
        watermarks: dict[str, int] = {}
        released = False
        try:
            rows: list[dict[str, Any]] = []
            more: list[tuple[str, int, list[tuple[str, dict[str, str]]]]] = []
            for task_id, _, claim in held:
                watermark, entries = int(claim[0]), _entries(claim[1])
                watermarks[task_id] = seq_of(entries[-1][0]) if entries else watermark
                if len(entries) < _ARCHIVE_BATCH:
                    rows += _rows(task_id, entries)
                else:
                    more.append((task_id, watermark, entries))
            for start in range(0, len(rows), _ARCHIVE_BATCH):
                await execute_at_once(
                    self.sessions.kw["bind"], events_insert(rows[start : start + _ARCHIVE_BATCH])
                )
            copied = len(rows)
            for task_id, watermark, entries in more:
                n, watermarks[task_id] = await self._copy(task_id, watermark, entries, None)
                copied += n
            await eval_many(
                self.redis,
                MARK_AND_RELEASE,
                self._mark_and_release.sha,
                [
                    (
                        [self.keys.events(t), self.keys.archived(t), self.keys.archiving(t)],
                        [watermarks[t], self.hot_ttl_ms],
                    )
                    for t, _, _ in held
                ],
            )
            released = True
        finally:
            if not released and held:
                await self.redis.delete(*(self.keys.archiving(t) for t, _, _ in held))
        await eval_many(
            self.redis,
            CLEAR_DIRTY,
            self._clear_dirty.sha,
            [([self.keys.archive_dirty], [t, score]) for t, score, _ in held],
        )
        return copied


def _rows(task_id: str, entries: list[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
    """Stream entries as ``events`` rows."""
    return [
        {
            "task_id": task_id,
            "seq": seq_of(eid),
            "type": f["t"],
            "timestamp": int(f["ts"]),
            "data": f["d"],
            "turn_id": turn_of(f["d"]),
        }
        for eid, f in entries
    ]


def _entries(raw: list[Any]) -> list[tuple[str, dict[str, str]]]:
    """XRANGE's reply as a script returns it: [id, [field, value, ...]] pairs."""
    return [(eid, dict(zip(flat[::2], flat[1::2], strict=True))) for eid, flat in raw]


class Archiver:
    """The loop that keeps PostgreSQL's ``events`` in step with Redis.

    Any number may run (one per worker process): writes are idempotent.
    """

    def __init__(self, log_: Copying, interval_seconds: float) -> None:
        self.log = log_
        self.interval = interval_seconds

    async def run(self) -> NoReturn:
        """Archive every ``interval`` seconds, for ever (run it in a ``Background``)."""
        await every(self.interval, self.log.archive_pending, what="archiving pass")

    async def flush(self) -> None:
        """A last pass, so a clean shutdown leaves nothing unarchived."""
        await self.log.archive_pending()
