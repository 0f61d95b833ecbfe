"""Which model providers the running loop-workers can serve.

Each worker advertises the providers it has keys for in ``Keys.providers``
(a sorted set scored by an expiry time) and refreshes it while it lives,
together with its own registration (``workers.announce``); the gateway
refuses a request for a provider no live worker advertises with a 422,
instead of accepting a turn that can only fail.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from redis.asyncio import Redis

from holdfast_shared.keys import Keys

ADVERTISE_SECONDS = 30


async def advertise(
    redis: Redis, keys: Keys, providers: Iterable[str], *, default_model: str | None = None
) -> None:
    """Say (again) that a live worker serves ``providers``, and which model it
    runs when a turn names none (the gateway checks a message's media against it)."""
    expires = int((time.time() + ADVERTISE_SECONDS) * 1000)
    await redis.zadd(keys.providers, {name: expires for name in providers}, gt=True)
    if default_model is not None:
        await redis.zadd(keys.default_models, {default_model: expires}, gt=True)


async def available_providers(redis: Redis, keys: Keys) -> set[str]:
    now = int(time.time() * 1000)
    names = await redis.zrangebyscore(keys.providers, now, "+inf")
    return {str(name) for name in names}


async def default_models(redis: Redis, keys: Keys) -> set[str]:
    """The default ``provider:model`` of every live worker (usually one)."""
    now = int(time.time() * 1000)
    specs = await redis.zrangebyscore(keys.default_models, now, "+inf")
    return {str(spec) for spec in specs}
