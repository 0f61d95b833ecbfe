"""Who is alive: the tool-runners (and what their sandbox can do), and which
model providers the live loop-workers serve.

Each tool-runner keeps ``Keys.runner_alive(id)`` (short TTL, its sandbox probe as
JSON) and its id in ``Keys.runners`` (scored by when that lapses). Others read the
first to tell a dead runner's calls; ``GET /health`` lists the second.

Each loop-worker advertises the providers it has keys for in ``Keys.providers``
(a sorted set scored by an expiry time) and refreshes it while it lives,
together with its own registration (``workers.announce``); the gateway
refuses a request for a provider no live worker advertises with a 422,
instead of accepting a turn that can only fail.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from redis.asyncio import Redis

from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import is_cluster

ALIVE_TTL_SECONDS = 6
ADVERTISE_SECONDS = 30


async def announce_runner(
    redis: Redis,
    keys: Keys,
    runner_id: str,
    sandbox: dict[str, Any],
    *,
    ttl_seconds: float = ALIVE_TTL_SECONDS,
) -> None:
    """Say (again) that ``runner_id`` lives, with what its sandbox can do.

    ``ttl_seconds`` (``HOLDFAST_LIVENESS_SECONDS`` in a runner) is also how soon its
    calls in flight are taken over and reported interrupted once it stops (``orphans``)."""
    expires = int((time.time() + ttl_seconds) * 1000)
    # Two slots in a Redis Cluster, where a MULTI cannot span them; neither order
    # matters to readers (live_runners skips an id whose key is missing).
    async with redis.pipeline(transaction=not is_cluster(redis)) as pipe:
        pipe.set(keys.runner_alive(runner_id), json.dumps(sandbox), px=int(ttl_seconds * 1000))
        pipe.zadd(keys.runners, {runner_id: expires})
        await pipe.execute()


async def withdraw_runner(redis: Redis, keys: Keys, runner_id: str) -> None:
    async with redis.pipeline(transaction=not is_cluster(redis)) as pipe:
        pipe.delete(keys.runner_alive(runner_id))
        pipe.zrem(keys.runners, runner_id)
        await pipe.execute()


async def live_runners(redis: Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    """Every live tool-runner's sandbox report, by runner id."""
    now = int(time.time() * 1000)
    await redis.zremrangebyscore(keys.runners, "-inf", now)
    ids = [str(i) for i in await redis.zrange(keys.runners, 0, -1)]
    if not ids:
        return {}
    reports = await redis.mget([keys.runner_alive(i) for i in ids])
    out: dict[str, dict[str, Any]] = {}
    for runner_id, raw in zip(ids, reports, strict=True):
        if raw is None:
            continue
        try:
            report = json.loads(raw)
        except ValueError:
            report = {}
        out[runner_id] = report if isinstance(report, dict) else {}
    return out


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
