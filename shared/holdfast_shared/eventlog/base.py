"""What every part of the event log holds: its clients, key names and scripts."""

from __future__ import annotations

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_shared.eventlog.scripts import (
    APPEND,
    CLAIM_AND_READ,
    CLEAR_DIRTY,
    MARK_AND_RELEASE,
    MARK_ARCHIVED,
)
from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import ClusterClient
from holdfast_shared.settings import get_settings


class LogBase:
    """The clients, key names and registered scripts that appending, reading and
    copying share (:class:`~holdfast_shared.eventlog.EventLog` is all three)."""

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
        self._append = redis.register_script(APPEND)
        self._cluster = redis if isinstance(redis, ClusterClient) else None
        if wait_replicas is None:
            settings = get_settings()
            wait_replicas, wait_timeout_ms = (
                settings.redis_wait_replicas,
                settings.redis_wait_timeout_ms,
            )
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._mark_archived = redis.register_script(MARK_ARCHIVED)
        self._claim_and_read = redis.register_script(CLAIM_AND_READ)
        self._mark_and_release = redis.register_script(MARK_AND_RELEASE)
        self._clear_dirty = redis.register_script(CLEAR_DIRTY)
