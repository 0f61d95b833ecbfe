"""Redis client construction."""

from __future__ import annotations

from redis.asyncio import Redis


def connect(url: str, *, max_connections: int = 200) -> Redis:
    """An asyncio client with string replies; accepts ``redis://`` and ``unix://`` URLs."""
    client: Redis = Redis.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        health_check_interval=30,
        socket_keepalive=True,
    )
    return client
