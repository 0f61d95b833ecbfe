"""The engine's shared queues as gauges, read by the gateway when it is scraped.

The job streams (``turns``, ``tools``, ``trajectories``) and the turns
parked on a question belong to no one process, so exactly one kind of
process reports them: the gateway, on each scrape of its ``/metrics``, at
most once per ``min_interval`` (several gateways or scrapers cost one
pipeline of nine Redis commands and one indexed count each interval; on
Redis 6.2, which reports no lag, one XRANGE per group that has one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from holdfast_shared.db.models import HitlRequestRecord
from holdfast_shared.keys import LEARNING_GROUP, TOOLS_GROUP, TURNS_GROUP, Keys
from holdfast_shared.observability import metrics
from holdfast_shared.streams import group_lag
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError
from sqlalchemy import distinct, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

log = logging.getLogger(__name__)


class QueueGauges:
    """Refreshes the stream and HITL gauges; cheap to call on every scrape."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        sessions: async_sessionmaker[AsyncSession],
        *,
        min_interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = redis
        self.sessions = sessions
        self.streams = {
            "turns": (keys.turns, TURNS_GROUP),
            "tools": (keys.tools, TOOLS_GROUP),
            "trajectories": (keys.trajectories, LEARNING_GROUP),
        }
        self.min_interval = min_interval
        self.clock = clock
        self._last: float | None = None

    async def refresh(self) -> None:
        """Read the queues unless that was done less than ``min_interval`` ago.
        A store that does not answer leaves its gauges as they were (logged)."""
        now = self.clock()
        if self._last is not None and now - self._last < self.min_interval:
            return
        self._last = now
        try:
            await self._streams()
        except RedisError as exc:
            log.warning("metrics: could not read the job streams: %s", exc)
        try:
            await self._waiting_turns()
        except SQLAlchemyError as exc:
            log.warning("metrics: could not count the parked turns: %s", exc)

    async def _streams(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, group in self.streams.values():
                pipe.xlen(key)
                pipe.xinfo_groups(key)
                pipe.xpending(key, group)
            replies = await pipe.execute(raise_on_error=False)
        now_ms = time.time() * 1000
        for n, (stream, (key, group)) in enumerate(self.streams.items()):
            length, groups, pending = replies[3 * n : 3 * n + 3]
            metrics.STREAM_LENGTH.labels(stream).set(0 if _missing(length) else int(length))
            info: dict[str, object] = {}
            if not _missing(groups):
                info = next((g for g in groups if _text(g.get("name")) == group), {})
            lag = await group_lag(self.redis, key, info) if info else 0
            metrics.STREAM_LAG.labels(stream, group).set(lag)
            if _missing(pending) or not pending.get("pending"):
                metrics.STREAM_PENDING.labels(stream, group).set(0)
                metrics.STREAM_OLDEST_PENDING.labels(stream, group).set(0)
                continue
            metrics.STREAM_PENDING.labels(stream, group).set(int(pending["pending"]))
            oldest_ms = int(_text(pending["min"]).partition("-")[0])
            metrics.STREAM_OLDEST_PENDING.labels(stream, group).set(
                max(0.0, (now_ms - oldest_ms) / 1000)
            )

    async def _waiting_turns(self) -> None:
        async with self.sessions() as session:
            waiting = await session.scalar(
                select(func.count(distinct(HitlRequestRecord.turn_id))).where(
                    HitlRequestRecord.status == "pending"
                )
            )
        metrics.HITL_WAITING_TURNS.set(waiting or 0)


def _missing(reply: object) -> bool:
    """A stream or group that does not exist yet (an error reply in the pipeline)."""
    if isinstance(reply, ResponseError):
        return True
    if isinstance(reply, Exception):
        raise reply
    return reply is None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
