"""One consumer of a Redis stream's consumer group, the same way for every service.

The loop-worker (``Keys.turns``), the tool-runner (``Keys.tools``) and the
learning service (``Keys.trajectories``) each consume a stream through a group.
What they share lives here: :class:`GroupConsumer` reads new entries
(``XREADGROUP``), takes over entries another consumer left idle past
``claim_idle_ms`` (``XAUTOCLAIM``, the scan going on from its cursor), takes
over the entries of consumers whose liveness key lapsed (``liveness``),
acknowledges, and rides out a Redis that lost its data (``NOGROUP``: the group
is created again) or does not answer. :func:`consume` is the read loop of a
consumer that runs each entry as a task of its own, up to a concurrency.

What each service does with an entry, when it acknowledges it, and what it
leaves pending for another consumer to take over stays in the service.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from holdfast_shared.liveness import claim_from_dead
from holdfast_shared.redisconn import closed_under_redis
from holdfast_shared.streams import ensure_group

log = logging.getLogger(__name__)

# How long one XREADGROUP waits for a new entry: also how long a stop may wait
# for the read under way to come back.
BLOCK_MS = 1000
# Before reading again after Redis did not answer.
_RETRY_SECONDS = 0.5

RedisUnavailable = (RedisConnectionError, RedisTimeoutError)


@dataclass(frozen=True, slots=True)
class Delivery:
    """A stream entry handed to this consumer: read new, or ``taken_over`` from a
    consumer that left it idle (or died)."""

    entry_id: str
    fields: dict[str, str]
    taken_over: bool = False


def is_nogroup(exc: ResponseError) -> bool:
    """The group (or its stream) is gone: Redis restarted empty, or someone deleted it.

    A read blocked when the stream is deleted ends with ``UNBLOCKED the stream key
    no longer exists`` (Redis 7) rather than ``NOGROUP``: the same loss, seen sooner.
    """
    message = str(exc)
    return "NOGROUP" in message or message.startswith("UNBLOCKED")


class GroupConsumer:
    """Consumer ``name`` of ``group`` on ``stream``.

    ``claim_idle_ms``: an entry delivered to another consumer and unacknowledged
    for that long is taken over. ``claim_calls``: XAUTOCLAIM looks at no more
    than 10 * COUNT pending entries per call, so one take-over goes on from the
    returned cursor for up to this many calls, and the next one resumes where
    it stopped, instead of only ever looking at the oldest live entries.
    ``on_group_created`` runs whenever this consumer created the group (at
    start, or after Redis lost it): what the stream held is gone, and the
    service may rebuild it from PostgreSQL.
    """

    def __init__(
        self,
        redis: Redis,
        stream: str,
        group: str,
        name: str,
        *,
        claim_idle_ms: int,
        claim_calls: int = 1,
        on_group_created: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.redis = redis
        self.stream = stream
        self.group = group
        self.name = name
        self.claim_idle_ms = claim_idle_ms
        self.claim_calls = claim_calls
        self.on_group_created = on_group_created
        self._claim_cursor = "0-0"

    async def ensure_group(self) -> None:
        """Create the group unless it exists (waiting while Redis does not answer)."""
        if await ensure_group(self.redis, self.stream, self.group) and self.on_group_created:
            await self.on_group_created()

    async def next_entries(self, count: int, *, block_ms: int = BLOCK_MS) -> list[Delivery]:
        """Up to ``count`` entries: those taken over first (they are the oldest), else
        new ones, waiting up to ``block_ms`` for one.

        Never raises for a Redis that lost the group (created again) or does not
        answer (after a short wait): it returns nothing, and the caller reads again.
        """
        try:
            taken = await self.take_over(count)
            if taken:
                return taken
            return await self.read_new(count, block_ms=block_ms)
        except ResponseError as exc:
            if not is_nogroup(exc):
                raise
            log.warning("the group %s is gone (Redis lost its data?); recreating it", self.group)
            await self.ensure_group()
        except Exception as exc:
            if not isinstance(exc, RedisUnavailable) and not closed_under_redis(exc):
                raise
            log.warning("Redis unreachable; retrying", exc_info=True)
            await asyncio.sleep(_RETRY_SECONDS)
        return []

    async def read_new(self, count: int, *, block_ms: int) -> list[Delivery]:
        """Up to ``count`` entries never delivered to the group (``XREADGROUP >``)."""
        reply = await self.redis.xreadgroup(
            self.group, self.name, {self.stream: ">"}, count=count, block=block_ms
        )
        return [Delivery(e[0], e[1]) for _stream, entries in reply or [] for e in entries]

    async def take_over(self, count: int) -> list[Delivery]:
        """Up to ``count`` entries other consumers left unacknowledged for ``claim_idle_ms``."""
        taken: list[Delivery] = []
        for _ in range(self.claim_calls):
            cursor, claimed, *_ = await self.redis.xautoclaim(
                self.stream,
                self.group,
                self.name,
                min_idle_time=self.claim_idle_ms,
                start_id=self._claim_cursor,
                count=count - len(taken),
            )
            self._claim_cursor = cursor
            # Redis 6.2 reports claimed-but-deleted entries as (None, None).
            taken += [Delivery(e[0], e[1], True) for e in claimed if e and e[0] and e[1]]
            if cursor == "0-0" or len(taken) >= count:
                break
        return taken

    async def take_from_dead(
        self, alive_key: Callable[[str], str], *, liveness_seconds: float, count: int
    ) -> list[tuple[str, Delivery]]:
        """Up to ``count`` entries of consumers whose liveness key lapsed, with the dead
        consumer's name (``liveness.claim_from_dead``); none while Redis does not
        answer (the read loop says so, and retries)."""
        try:
            claimed = await claim_from_dead(
                self.redis,
                self.stream,
                self.group,
                self.name,
                alive_key,
                liveness_seconds=liveness_seconds,
                count=count,
            )
        except RedisUnavailable:
            return []
        return [(dead, Delivery(entry_id, fields, True)) for dead, entry_id, fields in claimed]

    async def ack(self, *entry_ids: str) -> None:
        """Acknowledge entries: no consumer is handed them again."""
        if entry_ids:
            await self.redis.xack(self.stream, self.group, *entry_ids)


async def consume(
    consumer: GroupConsumer,
    stop: asyncio.Event,
    start: Callable[[Delivery], Awaitable[None]],
    running: Callable[[], Collection[asyncio.Task[Any]]],
    *,
    concurrency: int,
) -> None:
    """Read entries and ``start`` each until ``stop`` is set, with at most
    ``concurrency`` of the tasks ``running()`` lists at once.

    ``start`` returns once the entry is under way: the tasks it creates are the
    caller's, which lists them in ``running()``, acknowledges them, and waits
    for (or hands back) those still running after this returns. Entries read
    when ``stop`` is set are started all the same: they are this consumer's
    now, and the caller's shutdown deals with them.

    Who cancels: the service sets ``stop`` (SIGTERM) for a clean end; a
    cancellation from outside (its owner's shutdown) ends the loop at once, and
    the read under way is cancelled with it, leaving what it would have read
    for another consumer.

    The group exists already (:meth:`GroupConsumer.ensure_group`, before the
    service starts what else uses it); a group lost meanwhile is created again.
    """
    stop_wait = asyncio.create_task(stop.wait())
    read: asyncio.Task[list[Delivery]] | None = None
    try:
        while not stop.is_set():
            tasks = running()
            free = concurrency - len(tasks)
            if free <= 0:
                await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
                continue
            read = asyncio.create_task(consumer.next_entries(free))
            await asyncio.wait([read, stop_wait], return_when=asyncio.FIRST_COMPLETED)
            for delivery in await read:
                await start(delivery)
            read = None
    finally:
        stop_wait.cancel()
        if read is not None:
            read.cancel()
