"""Model calls under way per provider endpoint, so that background work yields
to the turns (#31, 4).

A local model server (llama.cpp, Ollama, LM Studio) serves one request at a
time, or aborts the one running for a new one (llama-cpp-python's
``interrupt_requests``): the learning centre's extraction calls made there
while a turn calls the same server slow the turn down or cut it off. So each
turn's model call is registered under its endpoint (the provider and its base
URL) while it streams (:func:`calling`), and the learning centre waits for the
endpoint to be quiet before each of its own (:func:`wait_until_quiet`).

Only self-hosted endpoints count (:func:`endpoint_of`): a hosted API serves
the turns and the learning centre side by side. A call is a member of
``Keys.model_calls(endpoint)`` scored by when it is given up for dead (its
time limit): a worker killed mid-call does not hold the learning centre back
for longer than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from redis.asyncio import Redis

from holdfast_shared.keys import Keys
from holdfast_shared.providers.base import Provider

_FIRST_POLL = 0.25
_LONGEST_POLL = 2.0


def endpoint_of(provider: Provider) -> str | None:
    """The self-hosted server ``provider`` calls (the openai provider's base
    URL, when it is not OpenAI's), or None: a hosted API's calls do not
    compete with one another, and are neither registered nor waited for."""
    endpoint = getattr(provider, "endpoint", None)
    return endpoint if isinstance(endpoint, str) else None


@contextlib.asynccontextmanager
async def calling(
    redis: Redis, keys: Keys, endpoint: str | None, *, limit_seconds: float
) -> AsyncIterator[None]:
    """Registers a model call on ``endpoint`` for as long as the block runs
    (at most ``limit_seconds``, should the process die inside it); nothing
    for no endpoint."""
    if endpoint is None:
        yield
        return
    key = keys.model_calls(endpoint)
    member = uuid.uuid4().hex
    expires = int((time.time() + limit_seconds) * 1000)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zadd(key, {member: expires})
        pipe.pexpire(key, int(limit_seconds * 1000))
        await pipe.execute()
    try:
        yield
    finally:
        await redis.zrem(key, member)


async def busy(redis: Redis, keys: Keys, endpoint: str) -> int:
    """How many turns' model calls are under way on ``endpoint``."""
    now = int(time.time() * 1000)
    return int(await redis.zcount(keys.model_calls(endpoint), now, "+inf"))


async def wait_until_quiet(redis: Redis, keys: Keys, endpoint: str, *, at_most: float) -> float:
    """Wait until no turn calls ``endpoint``, or ``at_most`` seconds; the seconds waited."""
    started = time.monotonic()
    poll = _FIRST_POLL
    while await busy(redis, keys, endpoint):
        waited = time.monotonic() - started
        if waited >= at_most:
            break
        await asyncio.sleep(min(poll, at_most - waited))
        poll = min(poll * 2, _LONGEST_POLL)
    return time.monotonic() - started
