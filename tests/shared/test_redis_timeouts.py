"""Every wait on Redis is finite (issue #29): the clients' socket timeout
(holdfast_shared.redisconn.timeouts), blocking waits in slices under it
(blpop_within), and a pub/sub listener that tells a quiet channel from a silent
Redis (holdfast_shared.pubsub). On a real Redis, partitioned by a FaultProxy."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlsplit

import pytest
from holdfast_shared import pubsub
from holdfast_shared.redisconn import blpop_within, connect, timeouts
from holdfast_shared.settings import get_settings
from redis import exceptions as redis_errors
from redis.asyncio import Redis

from holdfast.testing import FaultProxy, scaled

# The shortest socket timeout the settings allow: above the 5 s block slice.
SOCKET_TIMEOUT = 6.0


@pytest.fixture
def short_timeouts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("HOLDFAST_REDIS_SOCKET_TIMEOUT_SECONDS", str(SOCKET_TIMEOUT))
    monkeypatch.setenv("HOLDFAST_REDIS_CONNECT_TIMEOUT_SECONDS", "2")
    get_settings.cache_clear()
    yield
    monkeypatch.undo()
    get_settings.cache_clear()


@pytest.fixture
def proxy(redis_url: str) -> Iterator[FaultProxy]:
    parts = urlsplit(redis_url)
    if not parts.port:
        pytest.skip("a TCP Redis is needed for the fault proxy")
    with FaultProxy(parts.hostname or "127.0.0.1", parts.port) as proxy:
        yield proxy


@pytest.fixture
async def proxied(short_timeouts: None, proxy: FaultProxy, redis_url: str) -> AsyncIterator[Redis]:
    client = connect(proxy.url_for(redis_url), cluster=False)
    yield client
    proxy.heal()
    await client.aclose()


def test_the_timeouts_come_from_the_settings(short_timeouts: None) -> None:
    assert timeouts() == (SOCKET_TIMEOUT, 2.0)


def test_a_replica_wait_longer_than_the_socket_timeout_raises_it(
    short_timeouts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOLDFAST_REDIS_WAIT_TIMEOUT_MS", "20000")
    get_settings.cache_clear()
    assert timeouts()[0] == 21.0


async def test_a_blpop_longer_than_the_socket_timeout_waits_it_out(proxied: Redis) -> None:
    """One BLPOP of 8 s on a 6 s socket timeout would raise TimeoutError."""
    key = f"hftest:blpop:{secrets.token_hex(4)}"
    began = time.monotonic()
    assert await blpop_within(proxied, [key], SOCKET_TIMEOUT + 2) is None
    assert time.monotonic() - began >= SOCKET_TIMEOUT + 2
    await proxied.rpush(key, "late")
    assert await blpop_within(proxied, [key], 1) == (key, "late")


async def test_a_silent_redis_is_noticed_within_the_socket_timeout(
    proxied: Redis, proxy: FaultProxy
) -> None:
    await proxied.ping()
    proxy.set(blackhole=True)
    began = time.monotonic()
    with pytest.raises(redis_errors.TimeoutError):
        await proxied.get("anything")
    assert time.monotonic() - began < SOCKET_TIMEOUT + scaled(3)
    proxy.heal()
    assert await proxied.ping()


async def _listening(
    redis: Redis, channel: str, caplog: pytest.LogCaptureFixture
) -> tuple[asyncio.Task[None], list[str]]:
    got: list[str] = []

    async def handle(data: str) -> None:
        got.append(data)

    caplog.set_level(logging.WARNING, logger=pubsub.__name__)
    listener = asyncio.create_task(pubsub.listen(redis, channel, handle, what="test listener"))
    return listener, got


async def _published_until_heard(
    publisher: Redis, channel: str, got: list[str], data: str, within: float
) -> float:
    """Publish ``data`` until the listener has it (a subscription being made
    again misses what comes before it); the seconds it took."""
    began = time.monotonic()
    while data not in got:
        assert time.monotonic() - began < within, f"{data!r} never reached the listener"
        await publisher.publish(channel, data)
        await asyncio.sleep(0.2)
    return time.monotonic() - began


async def test_a_quiet_subscription_outlives_the_socket_timeout(
    proxied: Redis, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing published for twice the socket timeout: the listener's PINGs
    keep it from taking the quiet for a silent Redis."""
    channel = f"hftest:pubsub:{secrets.token_hex(4)}"
    listener, got = await _listening(proxied, channel, caplog)
    try:
        await _published_until_heard(redis, channel, got, "first", scaled(10))
        await asyncio.sleep(2 * SOCKET_TIMEOUT)
        await redis.publish(channel, "after the quiet")
        await _published_until_heard(redis, channel, got, "after the quiet", 1)
        assert "subscription lost" not in caplog.text
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener


async def test_a_partitioned_subscription_is_made_again(
    proxied: Redis, proxy: FaultProxy, redis: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis silent (a blackhole, nothing refused): the listener gives its
    subscription up within the socket timeout and a bit, and subscribes again
    once Redis answers."""
    channel = f"hftest:pubsub:{secrets.token_hex(4)}"
    listener, got = await _listening(proxied, channel, caplog)
    try:
        await _published_until_heard(redis, channel, got, "before", scaled(10))
        proxy.set(blackhole=True)
        began = time.monotonic()
        while "subscription lost" not in caplog.text:
            # The silence is seen after a third of the timeout (a PING) and a
            # whole one unanswered.
            assert time.monotonic() - began < 4 / 3 * SOCKET_TIMEOUT + scaled(4), caplog.text
            await asyncio.sleep(0.1)
        # The old connection, stalled in the proxy, must not be what recovers.
        proxy.reset_all()
        proxy.heal()
        await _published_until_heard(redis, channel, got, "after", scaled(15))
    finally:
        listener.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await listener
