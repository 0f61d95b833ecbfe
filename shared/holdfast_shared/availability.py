"""Which model providers the running loop-workers can serve.

Each worker advertises the providers it has keys for in ``Keys.providers``
(a sorted set scored by an expiry time) and refreshes it while it lives; the
gateway refuses a request for a provider no live worker advertises with a
422, instead of accepting a turn that can only fail.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from redis.asyncio import Redis

from holdfast_shared.keys import Keys

ADVERTISE_SECONDS = 30
REFRESH_SECONDS = 10


async def advertise(redis: Redis, keys: Keys, providers: Iterable[str]) -> None:
    expires = int((time.time() + ADVERTISE_SECONDS) * 1000)
    await redis.zadd(keys.providers, {name: expires for name in providers}, gt=True)


async def available_providers(redis: Redis, keys: Keys) -> set[str]:
    now = int(time.time() * 1000)
    names = await redis.zrangebyscore(keys.providers, now, "+inf")
    return {str(name) for name in names}
