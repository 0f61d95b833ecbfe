"""The per-task event log: append, read, and archive to PostgreSQL.

Layout. Each task has one Redis stream (``Keys.events``) whose entry ids are
``<seq>-0`` and whose fields are ``t`` (type), ``ts`` (timestamp) and ``d``
(the finished wire JSON). Readers never re-serialise: ``d`` goes to the SSE
client as it is.

Seq and timestamp. The append script assigns both inside Redis, so every
process (gateway, any worker) agrees: ``seq`` is the last seq + 1 and
``timestamp`` is ``max(redis TIME in ms, last timestamp + 1)`` — a logical
clock that runs ahead of the wall clock only while a task emits more than one
event per millisecond, and so is strictly increasing and as exact a cursor as
``seq``.

Durability. Every append bumps the task in ``Keys.archive_dirty``; the
:class:`Archiver` copies new entries to the ``events`` table (idempotent on
``(task_id, seq)``) and only then lets the stream expire,
``channel_state_ttl_active`` seconds after its last archived event. A stream
with unarchived events never expires. When the stream is gone, the next
append continues numbering from PostgreSQL, and readers stitch PostgreSQL
(older) and Redis (newer) together.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from redis.asyncio import Redis
from redis.exceptions import NoScriptError
from sqlalchemy import JSON, Text, bindparam, cast, column, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.sql.dml import UpdateBase

from holdfast_shared.appendbatch import AppendBatcher, eval_many
from holdfast_shared.background import every
from holdfast_shared.db.models import EventRecord
from holdfast_shared.errors import Superseded
from holdfast_shared.events import _Event, body_json, turn_of
from holdfast_shared.keys import Keys
from holdfast_shared.observability import metrics
from holdfast_shared.redisconn import ClusterClient
from holdfast_shared.settings import get_settings

log = logging.getLogger(__name__)

# KEYS: events stream, archived watermark, the task's turn lock, its turn epoch.
# ARGV: the task's name (the events' ``task_id``), turn_id ('' = null), floor
#       seq ('' = unknown), floor ts, release ('1' = release the turn lock if
#       turn_id holds it), epoch ('' = unfenced), the append's token ('' =
#       none; kept in the first entry's field ``a``), retry ('1' = this call
#       may have landed before: if an entry among the last 64 has the token,
#       answer as that append did instead of appending again), then (type,
#       body) pairs.
# Returns {first_seq, ts_1, ...}, {-1} when the stream is gone and the caller
# must supply the floor from PostgreSQL, or {-2} when another worker took the
# turn over (fenced).
_APPEND = """
if ARGV[6] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[6] then return {-2} end
if ARGV[8] == '1' and ARGV[7] ~= '' then
  local recent = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 64)
  for _, entry in ipairs(recent) do
    local f = entry[2]
    for i = 1, #f, 2 do
      if f[i] == 'a' and f[i + 1] == ARGV[7] then
        local n = (#ARGV - 8) / 2
        local landed = redis.call('XRANGE', KEYS[1], entry[1], '+', 'COUNT', n)
        local out = {tonumber(string.sub(entry[1], 1, string.find(entry[1], '-', 1, true) - 1))}
        for _, e in ipairs(landed) do
          for j = 1, #e[2], 2 do
            if e[2][j] == 'ts' then out[#out + 1] = tonumber(e[2][j + 1]) end
          end
        end
        return out
      end
    end
  end
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq, ts
if #last == 0 then
  if ARGV[3] == '' then return {-1} end
  seq = tonumber(ARGV[3]); ts = tonumber(ARGV[4])
else
  local id = last[1][1]
  seq = tonumber(string.sub(id, 1, string.find(id, '-', 1, true) - 1))
  local fields = last[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'ts' then ts = tonumber(fields[i + 1]) end
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local turn = 'null'
if ARGV[2] ~= '' then turn = '"' .. ARGV[2] .. '"' end
local head = '{"task_id":"' .. ARGV[1] .. '","turn_id":' .. turn .. ',"seq":'
local out = {seq + 1}
for i = 9, #ARGV, 2 do
  seq = seq + 1
  if now > ts then ts = now else ts = ts + 1 end
  local data = head .. string.format('%d', seq) .. ',"timestamp":' .. string.format('%d', ts)
    .. ',' .. string.sub(ARGV[i + 1], 2)
  if i == 9 and ARGV[7] ~= '' then
    redis.call('XADD', KEYS[1], string.format('%d', seq) .. '-0', 't', ARGV[i], 'ts',
      string.format('%d', ts), 'd', data, 'a', ARGV[7])
  else
    redis.call('XADD', KEYS[1], string.format('%d', seq) .. '-0', 't', ARGV[i], 'ts',
      string.format('%d', ts), 'd', data)
  end
  out[#out + 1] = ts
end
redis.call('PERSIST', KEYS[1])
redis.call('PERSIST', KEYS[2])
if ARGV[5] == '1' and redis.call('GET', KEYS[3]) == ARGV[2] then
  redis.call('DEL', KEYS[3])
end
return out
"""

# Records the watermark; lets the stream expire only when nothing is unarchived.
_MARK_FUNCTION = """
local function mark(events, archived, seq, ttl)
  redis.call('SET', archived, seq)
  local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)
  if #last == 0 then return 0 end
  local id = last[1][1]
  if tonumber(string.sub(id, 1, string.find(id, '-', 1, true) - 1)) == tonumber(seq) then
    redis.call('PEXPIRE', events, ttl)
    redis.call('PEXPIRE', archived, ttl)
    return 1
  end
  return 0
end
"""

# KEYS: events stream, archived watermark. ARGV: archived seq, ttl ms.
_MARK_ARCHIVED = _MARK_FUNCTION + "return mark(KEYS[1], KEYS[2], ARGV[1], ARGV[2])\n"

# KEYS: claim, archived watermark, events stream. ARGV: claim ms, count.
# Takes the task's archiving claim and, if it got it, reads the watermark and the
# first batch after it: one round trip where an archiving pass starts.
_CLAIM_AND_READ = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return false end
local watermark = tonumber(redis.call('GET', KEYS[2]) or '0')
return {watermark, redis.call('XRANGE', KEYS[3], (watermark + 1) .. '-0', '+', 'COUNT', ARGV[2])}
"""

# KEYS: events stream, archived watermark, claim. ARGV: archived seq (0: none), ttl ms.
# Ends an archiving pass: marks what it archived and gives the claim back.
_MARK_AND_RELEASE = (
    _MARK_FUNCTION
    + """
local marked = 0
if ARGV[1] ~= '0' then marked = mark(KEYS[1], KEYS[2], ARGV[1], ARGV[2]) end
redis.call('DEL', KEYS[3])
return marked
"""
)

# KEYS: dirty set. ARGV: task id, the score seen before archiving.
_CLEAR_DIRTY = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if score and tonumber(score) == tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 1
end
return 0
"""


# Longest one archiving pass of a task may hold its claim, and how long a
# caller that must have the events archived waits for another archiver.
_ARCHIVE_CLAIM_MS = 30_000
_CLAIM_WAIT_SECONDS = 5.0
_ARCHIVE_BATCH = 500


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """One event as stored: what an SSE frame needs, nothing parsed."""

    seq: int
    type: str
    data: str


@dataclass(frozen=True, slots=True)
class Appended:
    """Where an append landed: the first seq and each event's timestamp."""

    first_seq: int
    timestamps: tuple[int, ...]

    @property
    def last_seq(self) -> int:
        return self.first_seq + len(self.timestamps) - 1


async def next_epoch(redis: Redis, keys: Keys, task_id: str) -> int:
    """Start a new epoch for the task's turn: writers of older epochs are fenced off."""
    return int(await redis.incr(keys.turn_epoch(task_id)))


def _seq_of(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


class EventLog:
    """Append to and read from task event logs. Safe to share across tasks."""

    def __init__(
        self,
        redis: Redis,
        sessions: async_sessionmaker[AsyncSession],
        keys: Keys,
        *,
        hot_ttl_seconds: int,
        wait_replicas: int | None = None,
        wait_timeout_ms: int = 1000,
    ) -> None:
        """``wait_replicas`` (default: ``HOLDFAST_REDIS_WAIT_REPLICAS`` and its timeout)
        makes each append wait until that many replicas have it."""
        self.redis = redis
        self.sessions = sessions
        self.keys = keys
        self.hot_ttl_ms = hot_ttl_seconds * 1000
        self._append = redis.register_script(_APPEND)
        self._cluster = redis if isinstance(redis, ClusterClient) else None
        if wait_replicas is None:
            settings = get_settings()
            wait_replicas, wait_timeout_ms = (
                settings.redis_wait_replicas,
                settings.redis_wait_timeout_ms,
            )
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._batcher = AppendBatcher(
            redis,
            _APPEND,
            self._append.sha,
            keys.archive_dirty,
            wait_replicas=wait_replicas,
            wait_timeout_ms=wait_timeout_ms,
        )
        self._mark_archived = redis.register_script(_MARK_ARCHIVED)
        self._claim_and_read = redis.register_script(_CLAIM_AND_READ)
        self._mark_and_release = redis.register_script(_MARK_AND_RELEASE)
        self._clear_dirty = redis.register_script(_CLEAR_DIRTY)

    # -- writing ---------------------------------------------------------------
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
        # other turns' appends of this moment (appendbatch.py).
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
            await cluster.script_load(_APPEND)
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

    # -- reading ---------------------------------------------------------------
    async def read_hot(self, task_id: str, after_seq: int, count: int = 1000) -> list[LoggedEvent]:
        """Events after ``after_seq`` from the Redis copy (possibly fewer than exist)."""
        entries = await self.redis.xrange(
            self.keys.events(task_id), min=f"{after_seq + 1}-0", max="+", count=count
        )
        return [LoggedEvent(_seq_of(eid), f["t"], f["d"]) for eid, f in entries]

    async def first_hot_seq(self, task_id: str) -> int | None:
        entries = await self.redis.xrange(self.keys.events(task_id), count=1)
        return _seq_of(entries[0][0]) if entries else None

    async def last_hot_seq(self, task_id: str) -> int | None:
        entries = await self.redis.xrevrange(self.keys.events(task_id), count=1)
        return _seq_of(entries[0][0]) if entries else None

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
            low = _seq_of(first[0][0])
            last = await self.redis.xrevrange(key, count=1)
            high = _seq_of(last[0][0])
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

    # -- archiving -------------------------------------------------------------
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
                watermark = _seq_of(entries[-1][0])
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
            _CLAIM_AND_READ,
            self._claim_and_read.sha,
            [
                (
                    [self.keys.archiving(t), self.keys.archived(t), self.keys.events(t)],
                    [_ARCHIVE_CLAIM_MS, _ARCHIVE_BATCH],
                )
                for t, _ in dirty
            ],
        )
        # Tasks another archiver holds are left to it, their marks too.
        held = [(t, score, claim) for (t, score), claim in zip(dirty, claims, strict=True) if claim]
        watermarks: dict[str, int] = {}
        released = False
        try:
            rows: list[dict[str, Any]] = []
            more: list[tuple[str, int, list[tuple[str, dict[str, str]]]]] = []
            for task_id, _, claim in held:
                watermark, entries = int(claim[0]), _entries(claim[1])
                watermarks[task_id] = _seq_of(entries[-1][0]) if entries else watermark
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
                _MARK_AND_RELEASE,
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
            _CLEAR_DIRTY,
            self._clear_dirty.sha,
            [([self.keys.archive_dirty], [t, score]) for t, score, _ in held],
        )
        return copied


@dataclass(frozen=True, slots=True)
class Writes:
    """Statements to commit with a task's last unarchived events, sent with them as ONE
    SQL statement: each but the last becomes a data-modifying CTE of the last
    (``WITH w0 AS (INSERT ... events), w1 AS (INSERT ... message) INSERT ... snapshot``).
    A statement is atomic on its own, so it needs no transaction either: one round
    trip to PostgreSQL where a transaction of several statements takes one per
    statement plus BEGIN and COMMIT — what a turn pays at every iteration boundary.

    The statements must not touch the same row twice (PostgreSQL's rule for one
    statement), and see the database as it was before any of them.
    """

    statements: tuple[UpdateBase, ...]


Also = Callable[[AsyncSession], Awaitable[None]] | Writes


_EVENT_COLUMNS = ("task_id", "seq", "turn_id", "type", "timestamp", "data")


def events_insert(rows: Sequence[dict[str, Any]]) -> UpdateBase:
    """``INSERT INTO events SELECT * FROM json_to_recordset(<the rows>)``, idempotent.

    The same SQL text for any number of rows, with one parameter: SQLAlchemy
    compiles it once and psycopg can prepare it, where a multi-row VALUES is a
    new statement (and a new cache entry) for every batch size. The rows travel
    as one JSON text, which ``json.dumps`` writes in C: as one array per column
    they went through psycopg's array dumper, element by element in Python, a
    third of a streaming worker's archiving time.
    """
    table = EventRecord.__table__
    records = (
        func.json_to_recordset(
            cast(bindparam("hf_events", json.dumps(list(rows), ensure_ascii=False), Text), JSON)
        )
        .table_valued(*(column(name, table.c[name].type) for name in _EVENT_COLUMNS))
        .render_derived("hf_events", with_types=True)
    )
    return (
        insert(EventRecord)
        .from_select(list(_EVENT_COLUMNS), select(*(records.c[name] for name in _EVENT_COLUMNS)))
        .on_conflict_do_nothing()
    )


def one_statement(statements: Sequence[UpdateBase]) -> UpdateBase:
    """``statements`` as one: each but the last a data-modifying CTE of the last."""
    *first, last = statements
    if not first:
        return last
    return last.add_cte(*(s.cte(f"hf_write_{i}") for i, s in enumerate(first)))


async def execute_at_once(engine: AsyncEngine, statement: UpdateBase) -> None:
    """One statement, atomic on its own: no BEGIN and COMMIT round trips."""
    async with engine.connect() as connection:
        await connection.execution_options(isolation_level="AUTOCOMMIT")
        await connection.execute(statement)


def _rows(task_id: str, entries: list[tuple[str, dict[str, str]]]) -> list[dict[str, Any]]:
    """Stream entries as ``events`` rows."""
    return [
        {
            "task_id": task_id,
            "seq": _seq_of(eid),
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

    def __init__(self, log_: EventLog, interval_seconds: float) -> None:
        self.log = log_
        self.interval = interval_seconds

    async def run(self) -> NoReturn:
        """Archive every ``interval`` seconds, for ever (run it in a ``Background``)."""
        await every(self.interval, self.log.archive_pending, what="archiving pass")

    async def flush(self) -> None:
        """A last pass, so a clean shutdown leaves nothing unarchived."""
        await self.log.archive_pending()
