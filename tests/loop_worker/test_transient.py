"""Which PostgreSQL errors leave a turn to resume, which end it UNAVAILABLE
(holdfast_loop_worker.transient), on errors a real server raised."""

from __future__ import annotations

from pathlib import Path

import pytest
from holdfast_loop_worker.transient import store_refused, store_unreachable
from redis.asyncio import ConnectionPool, Redis
from redis.exceptions import ResponseError
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing.servers import RedisServer


async def _raised(sessions: async_sessionmaker[AsyncSession], errcode: str) -> DBAPIError:
    statement = text(
        "DO $$ BEGIN RAISE EXCEPTION 'could not extend file' USING ERRCODE = '"
        + errcode
        + "'; END $$"
    )
    async with sessions() as session:
        with pytest.raises(DBAPIError) as raised:
            await session.execute(statement)
    return raised.value


@pytest.mark.parametrize(
    ("errcode", "refused", "unreachable"),
    [
        ("disk_full", "53100", None),
        ("out_of_memory", "53200", None),
        ("too_many_connections", None, "PostgreSQL"),
        ("admin_shutdown", None, "PostgreSQL"),
        ("unique_violation", None, None),
    ],
)
async def test_postgres_errors(
    sessions: async_sessionmaker[AsyncSession],
    errcode: str,
    refused: str | None,
    unreachable: str | None,
) -> None:
    exc = await _raised(sessions, errcode)
    assert store_refused(exc) == refused
    assert store_unreachable(exc) == unreachable


async def test_a_connection_closed_under_a_write_is_redis_unreachable(redis_url: str) -> None:
    """redis-py's race (redis/redis-py#3546): another task closes the connection
    while this one awaits its health check, and the write then meets no writer.
    It raises AttributeError, not ConnectionError; it is Redis going away all
    the same, seen in the cluster chaos run as a master was killed."""
    conn = ConnectionPool.from_url(redis_url).make_connection()
    await conn.connect()

    async def closed_meanwhile() -> None:
        await conn.disconnect()

    conn.check_health = closed_meanwhile  # type: ignore[method-assign]
    with pytest.raises(AttributeError) as raised:
        await conn.send_command("PING")
    assert store_unreachable(raised.value) == "Redis"
    assert store_unreachable(AttributeError("a bug of ours")) is None


async def test_a_full_redis_leaves_the_turn_to_resume(tmp_path: Path) -> None:
    """At ``maxmemory`` (``noeviction``) Redis refuses writes, from a script too
    (how the event log appends; the embedded Redis 6.2 says so in a plain
    ResponseError): the turn waits, as for a restart. A server of its own: the
    shared one must not refuse the other tests' writes."""
    server = RedisServer(tmp_path / "redis", durable=False)
    server.start()
    redis = Redis.from_url(server.url)
    try:
        await redis.set("filler", "x" * 100_000)
        used = (await redis.info("memory"))["used_memory"]
        await redis.config_set("maxmemory", str(used // 2))
        with pytest.raises(ResponseError) as plain:
            await redis.set("key", "x")
        with pytest.raises(ResponseError) as scripted:
            await redis.eval("return redis.call('SET', KEYS[1], 'x')", 1, "key")
    finally:
        await redis.aclose()
        server.stop()
    assert store_unreachable(plain.value) == "Redis"
    assert store_unreachable(scripted.value) == "Redis"
