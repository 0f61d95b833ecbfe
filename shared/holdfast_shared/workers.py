"""Which loop-workers are alive: each one's own registration.

Each loop-worker keeps ``Keys.worker_alive(id)`` (short TTL, the providers it
serves as JSON) while it lives, and deletes it when it stops cleanly; a
killed worker's key lapses within its TTL (``HOLDFAST_LIVENESS_SECONDS`` in a
worker, refreshed by a heartbeat thread), and the others take its turns over
(``orphans``). The same step
advertises its providers (``liveness``) first, so a worker whose key
exists is one the gateway already routes turns to. Readers: whoever must know
that a given worker is up, such as ``holdfast.testing``'s readiness rule.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from redis.asyncio import Redis

from holdfast_shared.keys import Keys
from holdfast_shared.liveness import advertise

ALIVE_TTL_SECONDS = 6


async def announce(
    redis: Redis,
    keys: Keys,
    worker_id: str,
    providers: Collection[str],
    *,
    default_model: str | None = None,
    ttl_seconds: float = ALIVE_TTL_SECONDS,
) -> None:
    """Say (again) that ``worker_id`` lives and serves ``providers``.

    ``ttl_seconds`` (``HOLDFAST_LIVENESS_SECONDS`` in a worker) is also how soon the
    other workers take its turns over once it stops saying so (``orphans``)."""
    await advertise(redis, keys, providers, default_model=default_model)
    report = json.dumps({"providers": sorted(providers)})
    await redis.set(keys.worker_alive(worker_id), report, px=int(ttl_seconds * 1000))


async def withdraw(redis: Redis, keys: Keys, worker_id: str) -> None:
    """Say that ``worker_id`` has stopped (its providers lapse on their own)."""
    await redis.delete(keys.worker_alive(worker_id))
