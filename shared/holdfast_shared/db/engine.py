"""Async engine and session factory (SQLAlchemy 2 + psycopg 3)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import event, exc
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection

# A pooled connection idle for longer than this is pinged before it is handed
# out (one round trip); one used more recently is handed out as it is.
PING_AFTER_IDLE_SECONDS = 1.0
# A new connection that is not set up by then fails (libpq's connect_timeout)
# instead of waiting on a server that accepted the TCP connection and says
# nothing: a stalled or partitioned PostgreSQL.
CONNECT_TIMEOUT_SECONDS = 10


def to_async_url(url: str) -> str:
    """Accept ``postgresql://`` URLs and point them at the psycopg 3 driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres", "postgresql+psycopg2"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def create_engine(
    url: str,
    *,
    pool_size: int = 10,
    keep: int | None = None,
    ping_after_idle: float = PING_AFTER_IDLE_SECONDS,
) -> AsyncEngine:
    """An engine that holds up to ``2 * pool_size`` connections at once and keeps
    ``pool_size`` of them open between uses, or ``keep`` if fewer
    (``Settings.database_pool_size``)."""
    kept = min(pool_size, keep) if keep else pool_size
    engine = _create_async_engine(
        to_async_url(url),
        pool_size=kept,
        max_overflow=2 * pool_size - kept,
        # Statement parameters are user content (messages, answers): an error
        # logs the statement without them.
        hide_parameters=True,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_SECONDS},
    )
    ping_when_idle(engine.sync_engine, ping_after_idle)
    return engine


def ping_when_idle(engine: Engine, idle_seconds: float) -> None:
    """Ping a pooled connection at checkout only when it sat idle for ``idle_seconds``.

    SQLAlchemy's ``pool_pre_ping`` pings at every checkout: a loop-worker
    checks out a connection about ten times per turn, and those pings were a
    quarter of its round trips to PostgreSQL. A connection that ran a statement
    a moment ago is alive; one that sat idle may have been cut (a restarted
    server, a proxy's idle timeout) and is pinged, and replaced when dead, as
    pre-ping would. A connection that dies between its last use and the next
    (inside ``idle_seconds``) fails that statement, which SQLAlchemy reports as
    a disconnect and answers by replacing the pool's connections.
    """
    dialect = engine.dialect

    @event.listens_for(engine, "checkin")
    def _checked_in(dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(
        dbapi_connection: Any, record: ConnectionPoolEntry, proxy: PoolProxiedConnection
    ) -> None:
        since = record.info.pop("idle_since", None)
        if since is None or time.monotonic() - since < idle_seconds:
            return  # new, or used a moment ago
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as error:
            if dialect.is_disconnect(error, dbapi_connection, None):
                # The pool replaces it (and the others as old) and checks out again.
                raise exc.InvalidatePoolError(str(error)) from error
            raise


def session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def autocommit_session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions in autocommit, on the same pool: each statement is its own round
    trip and its own transaction, with no BEGIN before it and no COMMIT or
    ROLLBACK after (two round trips a session saves). For look-ups (a
    transaction at READ COMMITTED gives each statement a snapshot of its own
    anyway, so they see the same) and for writes of ONE statement, atomic
    alone; never for writes that must commit together."""
    return async_sessionmaker(
        engine.execution_options(isolation_level="AUTOCOMMIT"), expire_on_commit=False
    )
