"""Listening to a Redis pub/sub channel for as long as a process lives."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from holdfast_shared.redisconn import timeouts

log = logging.getLogger(__name__)

# A subscription is read in polls this long, and pinged when it has been quiet
# for a third of the socket timeout: a quiet channel and a silent Redis look
# alike until a PING goes unanswered for the whole socket timeout.
POLL_SECONDS = 1.0
_PING = "holdfast-pubsub"


async def listen(
    redis: Redis, channel: str, handle: Callable[[str], Awaitable[None]], *, what: str
) -> NoReturn:
    """Call ``handle`` with each message's data, for ever (run it in a ``Background``).

    A dropped connection (Redis restarting), or one on which Redis stays silent
    longer than the socket timeout (a partition: nothing is refused, nothing
    answered), subscribes again after a second; messages published meanwhile
    are missed, as pub/sub is at most once: use it only for nudges whose effect
    is also reached another way. A failing ``handle`` is logged (``what`` names
    the listener) and the next message is handled.
    """
    while True:
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(channel)
            await _read(pubsub, handle, what=what)
        except Exception:
            log.warning("%s: subscription lost; subscribing again", what, exc_info=True)
            await asyncio.sleep(1)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]  # untyped in redis-py


async def _read(pubsub: PubSub, handle: Callable[[str], Awaitable[None]], *, what: str) -> None:
    """Handle messages until Redis has said nothing, not even to a PING, for the
    socket timeout (then raise TimeoutError)."""
    silence_limit = timeouts()[0]
    heard = pinged = time.monotonic()
    while True:
        message = await pubsub.get_message(timeout=POLL_SECONDS)
        now = time.monotonic()
        if message is not None:
            heard = now
            if message.get("type") == "message":
                try:
                    await handle(str(message["data"]))
                except Exception:
                    log.exception("%s: handling %r failed", what, message["data"])
            continue
        if now - heard > silence_limit:
            raise TimeoutError(f"Redis answered nothing for {now - heard:.0f} s")
        if now - max(heard, pinged) > silence_limit / 3:
            await pubsub.ping(_PING)
            pinged = now
