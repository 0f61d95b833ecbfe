"""A fresh database: created on a PostgreSQL server, migrated, given API keys, dropped.

Every function blocks. Migrations and key registration run the engine's own
code (Alembic, ``holdfast_shared.apikeys``), which runs an event loop of its
own: they run in a thread of their own, so callers may be anywhere, inside an
event loop included.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import psycopg
from holdfast_shared.apikeys import add_key, generate_key
from holdfast_shared.db import create_engine, session_factory, upgrade_head
from sqlalchemy.engine import make_url

T = TypeVar("T")

_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def with_database(server_url: str, name: str) -> str:
    """``server_url`` pointing at database ``name`` instead."""
    return make_url(server_url).set(database=name).render_as_string(hide_password=False)


def libpq_url(url: str) -> str:
    """The same URL for psycopg (no ``+driver`` part)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def create_database(server_url: str, name: str) -> str:
    """Create database ``name`` on the server of ``server_url`` (any database
    there that the user may create databases from), bring its schema up to
    date, and return its URL."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"database name {name!r}: lower-case letters, digits and _ only")
    with psycopg.connect(libpq_url(server_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = with_database(server_url, name)
    try:
        _in_a_thread(lambda: upgrade_head(url))
    except BaseException:
        drop_database(server_url, name)
        raise
    return url


def drop_database(server_url: str, name: str) -> None:
    """Drop database ``name``, disconnecting whoever still uses it."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"database name {name!r}: lower-case letters, digits and _ only")
    with psycopg.connect(libpq_url(server_url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def add_api_key(database_url: str, tenant: str, key: str | None = None) -> str:
    """Register ``key`` (generated when not given) for ``tenant``, creating the
    tenant if new; return the key."""
    key = key or generate_key()

    async def add() -> None:
        engine = create_engine(database_url, pool_size=1)
        try:
            async with session_factory(engine).begin() as session:
                await add_key(session, tenant, key, name="holdfast.testing")
        finally:
            await engine.dispose()

    _in_a_thread(lambda: asyncio.run(add()))
    return key


def _in_a_thread(fn: Callable[[], T]) -> T:
    with ThreadPoolExecutor(1, thread_name_prefix="holdfast-testing") as pool:
        return pool.submit(fn).result()
