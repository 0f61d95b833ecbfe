"""The engine's connection pool: a connection is pinged only after it sat idle."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from holdfast_shared.db import create_engine
from sqlalchemy import text


async def _pid(engine: Any) -> int:
    async with engine.connect() as connection:
        return int(await connection.scalar(text("select pg_backend_pid()")))


def _count_pings(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    dialect = engine.sync_engine.dialect
    pings: list[int] = []
    real = dialect.do_ping

    def counted(dbapi_connection: Any) -> bool:
        pings.append(1)
        return bool(real(dbapi_connection))

    monkeypatch.setattr(dialect, "do_ping", counted)
    return pings


async def test_a_connection_used_a_moment_ago_is_not_pinged(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = create_engine(database_url, pool_size=1, ping_after_idle=30)
    pings = _count_pings(engine, monkeypatch)
    try:
        first = await _pid(engine)
        assert [await _pid(engine) for _ in range(5)] == [first] * 5
        assert pings == []
    finally:
        await engine.dispose()


async def test_an_idle_connection_cut_by_the_server_is_replaced(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = create_engine(database_url, pool_size=1, ping_after_idle=0.2)
    other = create_engine(database_url, pool_size=1)
    pings = _count_pings(engine, monkeypatch)
    try:
        first = await _pid(engine)
        async with other.connect() as connection:
            await connection.execute(text(f"select pg_terminate_backend({first})"))
        await asyncio.sleep(0.4)
        # The pooled connection is dead: the ping finds out, and a new one answers.
        second = await _pid(engine)
        assert second != first
        assert len(pings) == 1
        # The new connection sat idle long enough too: pinged, alive, kept.
        await asyncio.sleep(0.4)
        assert await _pid(engine) == second
        assert len(pings) == 2
    finally:
        await engine.dispose()
        await other.dispose()
