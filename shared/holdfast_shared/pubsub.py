"""Listening to a Redis pub/sub channel for as long as a process lives."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import NoReturn

from redis.asyncio import Redis

log = logging.getLogger(__name__)


async def listen(
    redis: Redis, channel: str, handle: Callable[[str], Awaitable[None]], *, what: str
) -> NoReturn:
    """Call ``handle`` with each message's data, for ever (run it in a ``Background``).

    A dropped connection (Redis restarting) subscribes again after a second;
    messages published meanwhile are missed, as pub/sub is at most once: use
    it only for nudges whose effect is also reached another way. A failing
    ``handle`` is logged (``what`` names the listener) and the next message
    is handled.
    """
    while True:
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(channel)
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                try:
                    await handle(str(message["data"]))
                except Exception:
                    log.exception("%s: handling %r failed", what, message["data"])
        except Exception:
            log.warning("%s: subscription lost; subscribing again", what, exc_info=True)
            await asyncio.sleep(1)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py
