"""runtime.Presence on a real Redis: a consumer process is announced and beating before
it reads, re-announced while it lives, and withdrawn (key gone) when it stops."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

from holdfast_shared.background import Background
from holdfast_shared.liveness import Heartbeat
from holdfast_shared.runtime import Presence, process_name
from redis.asyncio import Redis

WITHIN = 20.0


async def test_presence_announces_first_refreshes_and_withdraws(
    redis: Redis, redis_url: str, redis_prefix: str
) -> None:
    alive = f"{redis_prefix}presence:{uuid.uuid4().hex}"
    announced = f"{alive}:announced"
    announcements = 0
    again = asyncio.Event()

    async def announce() -> None:
        nonlocal announcements
        announcements += 1
        await redis.set(announced, str(announcements))
        if announcements >= 3:
            again.set()

    async def withdraw() -> None:
        await redis.delete(announced)

    presence = Presence(
        Heartbeat(redis_url, alive, "me", ttl_seconds=0.4),
        announce,
        withdraw,
        liveness_seconds=0.4,
        what="announcing the test process",
    )
    async with Background() as background:
        await presence.start(background)
        # Before start returns: what a consumer must have before its first read.
        assert announcements == 1 and await redis.get(alive) == "me"
        await asyncio.wait_for(again.wait(), WITHIN)  # every quarter of the TTL
    await presence.stop()
    assert not await redis.exists(alive, announced)
    # The block that re-announced is gone: nothing announces it again (a negative,
    # so a wait of three refreshes rather than an event).
    count = announcements
    await asyncio.sleep(0.3)
    assert announcements == count and not await redis.exists(announced)


def test_process_name_is_unique_per_host_and_process() -> None:
    assert process_name() == f"{socket.gethostname()}-{os.getpid()}"
