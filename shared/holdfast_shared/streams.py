"""Consumer groups on Redis streams, the same way for every service."""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger(__name__)


async def ensure_group(redis: Redis, stream: str, group: str) -> bool:
    """Create the group (and the stream) unless they exist; True when this call created it.

    The group starts at "0", so entries appended before any consumer started
    are still read. While Redis is unreachable (starting, restarting) it
    waits and tries again instead of failing the service.
    """
    delay = 0.2
    while True:
        try:
            await redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
            return False
        except (RedisConnectionError, RedisTimeoutError):
            log.warning("Redis unreachable while creating group %s; retrying", group)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            continue
        return True


# Past this many undelivered entries a group's lag is reported as this many: the
# count costs an XRANGE of that size, and a gauge only needs to say "far behind".
LAG_COUNT_CAP = 10_000


async def group_lag(redis: Redis, stream: str, group: dict[str, object]) -> int:
    """Entries of ``stream`` not yet delivered to ``group`` (an ``XINFO GROUPS`` row).

    Redis 7 reports this as ``lag``; Redis 6.2 (the embedded server) does not,
    so it is counted from the group's ``last-delivered-id``, up to
    :data:`LAG_COUNT_CAP`.
    """
    lag = group.get("lag")
    if lag is not None:
        return int(str(lag))
    last = str(group.get("last-delivered-id") or "0-0")
    if last in ("0-0", "0"):
        return min(int(await redis.xlen(stream)), LAG_COUNT_CAP)
    after = await redis.xrange(stream, min=f"({last}", count=LAG_COUNT_CAP)
    return len(after)
