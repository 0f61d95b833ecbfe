"""Redis client construction."""

from __future__ import annotations

from redis.asyncio import Redis


def connect(url: str, *, max_connections: int = 200) -> Redis:
    """An asyncio client with string replies; accepts ``redis://`` and ``unix://`` URLs."""
    # TCP keepalive makes no sense on a unix socket, and redis-py refuses it there.
    options = {} if url.startswith("unix://") else {"socket_keepalive": True}
    client: Redis = Redis.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        health_check_interval=30,
        **options,
    )
    return client
