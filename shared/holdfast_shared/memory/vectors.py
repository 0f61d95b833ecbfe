"""Memory vectors in PostgreSQL with pgvector, where the server has it.

pgvector ships with the embedded PostgreSQL and compose's image, but a plain
PostgreSQL may lack it. So ``memory_vectors`` is no ORM model and no Alembic
migration (a migration cannot depend on an extension being there):
:func:`install` creates the extension and the table after the migrations
where the server has ``vector``, and reports instead of failing where it has
not; :func:`probe` says which for ``/health``; retrieval then uses full text
alone. The Alembic environment ignores the table when it compares schemas.

One table holds every kind's vectors (``kind`` is ``knowledge``, ``episodes``
or ``social``, ``item_id`` the row's id there) of every embedder: vectors of
different embedders are never compared, and switching embedders leaves the
old ones to be deleted or re-embedded. The ``embedding`` column has no fixed
size, so each embedder gets its own partial HNSW index on the column cast to
its size (:func:`ensure_index`), as pgvector's documentation describes for
columns of varying dimensions, and :func:`nearest` repeats that cast and
predicate with the embedder's name as a literal, so the planner can use the
index even for a prepared statement. Sizes over pgvector's HNSW limit for
``vector`` (2,000) are indexed as ``halfvec`` (up to 4,000); larger ones are
searched exactly.

DDL runs under a transaction-scoped advisory lock: several services start at
once and ``CREATE ... IF NOT EXISTS`` alone races on the catalogue.

Vectors travel as pgvector's text form (``'[0.1,0.2]'``) cast in SQL, so no
driver adapter needs registering on the pool's connections.
"""

from __future__ import annotations

import asyncio
import logging
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

log = logging.getLogger(__name__)

TABLE = "memory_vectors"
# pg_advisory_xact_lock key of the DDL here ("hfvector" in ASCII).
_DDL_LOCK = 0x6866766563746F72
# pgvector's HNSW limits: vector up to 2,000 dimensions, halfvec up to 4,000.
_VECTOR_INDEX_MAX = 2000
_HALFVEC_INDEX_MAX = 4000
# Embedder names are spliced into SQL as literals (see the module docstring):
# only these characters, so no quoting can ever be needed.
_EMBEDDER_NAME = re.compile(r"[A-Za-z0-9._:@/+-]{1,200}")

MISSING = "pgvector extension not installed in this PostgreSQL; retrieval uses full text only"

_CREATE_TABLE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    kind text NOT NULL,
    item_id text NOT NULL,
    tenant_id text NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    user_id text NOT NULL DEFAULT '',
    embedder text NOT NULL,
    dims integer NOT NULL,
    embedding vector NOT NULL,
    PRIMARY KEY (kind, item_id, embedder)
)
"""
_CREATE_BRAIN_INDEX = f"CREATE INDEX IF NOT EXISTS ix_{TABLE}_brain ON {TABLE} (tenant_id, user_id)"


@dataclass(frozen=True, slots=True)
class VectorSupport:
    """Whether similarity search can run here, and why not when it cannot."""

    available: bool
    reason: str
    # pgvector's version in this database, when installed ("0.8.1").
    version: str | None = None

    @property
    def halfvec(self) -> bool:
        """halfvec (and its HNSW index) came with pgvector 0.7.0."""
        return self.available and _version(self.version) >= (0, 7, 0)

    @property
    def iterative_scan(self) -> bool:
        """Iterative HNSW scans (filters that do not starve the index) came with 0.8.0."""
        return self.available and _version(self.version) >= (0, 8, 0)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"status": "ok" if self.available else "unavailable"}
        if self.version:
            body["pgvector"] = self.version
        if not self.available:
            body["reason"] = self.reason
        return body


def _version(value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    return tuple(int(part) for part in re.findall(r"\d+", value)[:3])


# --- installing -----------------------------------------------------------------


async def _server_has_vector(connection: AsyncConnection) -> bool:
    found = await connection.execute(
        text("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")
    )
    return found.first() is not None


async def install(engine: AsyncEngine) -> VectorSupport:
    """Create the ``vector`` extension and ``memory_vectors`` where the server has pgvector.

    Idempotent and safe to run from several processes at once. Never raises
    for want of pgvector, nor when the extension cannot be created (a user
    without the right to): it returns why, and retrieval uses full text.
    """
    async with engine.connect() as connection:
        if not await _server_has_vector(connection):
            return VectorSupport(False, MISSING)
    try:
        async with engine.begin() as connection:
            await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _DDL_LOCK})
            await connection.execute(text("CREATE EXTENSION IF NOT EXISTS vector"))
            await connection.execute(text(_CREATE_TABLE))
            await connection.execute(text(_CREATE_BRAIN_INDEX))
    except DBAPIError as exc:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        return VectorSupport(
            False,
            f"pgvector is available but could not be installed ({reason}); "
            "retrieval uses full text only",
        )
    async with engine.connect() as connection:
        return await probe(connection)


def install_blocking(database_url: str) -> VectorSupport:
    """:func:`install` from synchronous code (``upgrade_head``); runs its own event loop."""
    from holdfast_shared.db.engine import create_engine

    async def run() -> VectorSupport:
        engine = create_engine(database_url, pool_size=1)
        try:
            return await install(engine)
        finally:
            await engine.dispose()

    support = asyncio.run(run())
    if support.available:
        log.info("memory vectors: pgvector %s", support.version)
    else:
        log.warning("memory vectors: %s", support.reason)
    return support


async def probe(connection: AsyncConnection | AsyncSession) -> VectorSupport:
    """What this database offers now (for ``/health`` and a service's start)."""
    row = (
        await connection.execute(
            text(
                "SELECT (SELECT extversion FROM pg_extension WHERE extname = 'vector'), "
                "EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'vector'), "
                f"to_regclass('{TABLE}') IS NOT NULL"
            )
        )
    ).one()
    version, on_server, has_table = row
    if version is not None and has_table:
        return VectorSupport(True, f"pgvector {version}", version)
    if on_server:
        return VectorSupport(
            False,
            "pgvector is available in this PostgreSQL but not installed in this database "
            "(run the migrations as a user that may CREATE EXTENSION); "
            "retrieval uses full text only",
            version,
        )
    return VectorSupport(False, MISSING)


# --- the index of one embedder ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Plan:
    """How vectors of one size are cast, compared and indexed."""

    cast: str  # "vector(384)"
    ops: str | None  # the HNSW operator class, None: no index, exact search

    @classmethod
    def of(cls, dims: int, support: VectorSupport) -> _Plan:
        if dims <= _VECTOR_INDEX_MAX:
            return cls(f"vector({dims})", "vector_cosine_ops")
        if dims <= _HALFVEC_INDEX_MAX and support.halfvec:
            return cls(f"halfvec({dims})", "halfvec_cosine_ops")
        return cls(f"vector({dims})", None)


def _checked_name(embedder: str) -> str:
    if not _EMBEDDER_NAME.fullmatch(embedder):
        raise ValueError(f"embedder name {embedder!r}: letters, digits and ._:@/+- only")
    return embedder


def index_name(embedder: str) -> str:
    """The HNSW index of ``embedder``: readable, and unique within 63 bytes."""
    readable = re.sub(r"[^a-z0-9]+", "_", embedder.lower()).strip("_")[:36]
    return f"ix_{TABLE}_{readable}_{zlib.crc32(embedder.encode()):08x}"


def _predicate(embedder: str, dims: int) -> str:
    return f"embedder = '{_checked_name(embedder)}' AND dims = {int(dims)}"


async def ensure_index(
    engine: AsyncEngine, embedder: str, dims: int, support: VectorSupport
) -> str | None:
    """Create the HNSW index of ``embedder``'s vectors if missing; its name, or
    None when vectors of this size are searched exactly (no index possible).

    Call it once at a service's start, after :func:`probe` said available.
    Building it over many existing vectors takes a while; later inserts
    update it as they come.
    """
    plan = _Plan.of(dims, support)
    if plan.ops is None:
        return None
    name = index_name(embedder)
    async with engine.begin() as connection:
        await connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _DDL_LOCK})
        await connection.execute(
            text(
                f"CREATE INDEX IF NOT EXISTS {name} ON {TABLE} "
                f"USING hnsw ((embedding::{plan.cast}) {plan.ops}) "
                f"WHERE {_predicate(embedder, dims)}"
            )
        )
    return name


# --- rows --------------------------------------------------------------------------


def literal(vector: Sequence[float]) -> str:
    """pgvector's text form of ``vector``."""
    return "[" + ",".join(f"{x:.7g}" for x in vector) + "]"


def _is_zero(vector: Sequence[float]) -> bool:
    return not any(vector)


async def upsert(
    session: AsyncSession,
    kind: str,
    item_id: str,
    tenant_id: str,
    user_id: str,
    embedder: str,
    vector: Sequence[float],
) -> None:
    """Store (or replace) the vector of one item. A zero vector (a text with
    nothing to embed) stores nothing, and removes what was there."""
    await upsert_many(session, kind, embedder, [(item_id, tenant_id, user_id, vector)])


async def upsert_many(
    session: AsyncSession,
    kind: str,
    embedder: str,
    rows: Sequence[tuple[str, str, str, Sequence[float]]],
) -> None:
    """:func:`upsert` for many ``(item_id, tenant_id, user_id, vector)`` at once."""
    _checked_name(embedder)
    empty = [item_id for item_id, _, _, vector in rows if _is_zero(vector)]
    if empty:
        await delete(session, kind, empty, embedder=embedder)
    params = [
        {
            "kind": kind,
            "item_id": item_id,
            "tenant_id": tenant_id,
            "user_id": user_id,
            "embedder": embedder,
            "dims": len(vector),
            "embedding": literal(vector),
        }
        for item_id, tenant_id, user_id, vector in rows
        if not _is_zero(vector)
    ]
    if not params:
        return
    await session.execute(
        text(
            f"INSERT INTO {TABLE} (kind, item_id, tenant_id, user_id, embedder, dims, embedding) "
            "VALUES (:kind, :item_id, :tenant_id, :user_id, :embedder, :dims, "
            "CAST(:embedding AS vector)) "
            "ON CONFLICT (kind, item_id, embedder) DO UPDATE SET "
            "tenant_id = EXCLUDED.tenant_id, user_id = EXCLUDED.user_id, "
            "dims = EXCLUDED.dims, embedding = EXCLUDED.embedding"
        ),
        params,
    )


async def delete(
    session: AsyncSession, kind: str, item_ids: Sequence[str], *, embedder: str | None = None
) -> int:
    """Remove the vectors of these items (of every embedder, unless one is named)."""
    if not item_ids:
        return 0
    sql = f"DELETE FROM {TABLE} WHERE kind = :kind AND item_id = ANY(:ids)"
    params: dict[str, Any] = {"kind": kind, "ids": list(item_ids)}
    if embedder is not None:
        sql += " AND embedder = :embedder"
        params["embedder"] = embedder
    result = await session.execute(text(sql), params)
    return int(getattr(result, "rowcount", 0) or 0)


async def delete_brain(session: AsyncSession, tenant_id: str, user_id: str | None = None) -> int:
    """Remove a tenant's vectors, or only one end user's (``DELETE /memory?user_id=``)."""
    sql = f"DELETE FROM {TABLE} WHERE tenant_id = :tenant_id"
    params: dict[str, Any] = {"tenant_id": tenant_id}
    if user_id is not None:
        sql += " AND user_id = :user_id"
        params["user_id"] = user_id
    result = await session.execute(text(sql), params)
    return int(getattr(result, "rowcount", 0) or 0)


async def nearest(
    session: AsyncSession,
    kind: str,
    tenant_id: str,
    user_id: str,
    embedder: str,
    vector: Sequence[float],
    limit: int,
    *,
    support: VectorSupport,
) -> list[tuple[str, float]]:
    """The ``limit`` items of one brain nearest to ``vector``: ``(item_id,
    cosine distance)``, nearest first. Uses ``embedder``'s HNSW index (see
    :func:`ensure_index`); with pgvector 0.8+ the scan goes on until enough
    rows of this brain are found, however many other brains share the index.
    """
    if limit <= 0 or _is_zero(vector):
        return []
    dims = len(vector)
    plan = _Plan.of(dims, support)
    if plan.ops is not None:
        # Enough candidates for the limit (pgvector's default is 40, its maximum 1000).
        # Both for this transaction only, in one round trip.
        ef_search = min(max(40, 2 * limit), 1000)
        settings = "SELECT set_config('hnsw.ef_search', :ef_search, true)"
        if support.iterative_scan:
            settings += ", set_config('hnsw.iterative_scan', 'relaxed_order', true)"
        await session.execute(text(settings), {"ef_search": str(ef_search)})
    distance = f"embedding::{plan.cast} <=> CAST(:q AS {plan.cast})"
    # relaxed_order may return rows slightly out of order: sort the few again.
    rows = await session.execute(
        text(
            f"WITH found AS MATERIALIZED ("
            f"SELECT item_id, {distance} AS distance FROM {TABLE} "
            f"WHERE {_predicate(embedder, dims)} AND kind = :kind "
            "AND tenant_id = :tenant_id AND user_id = :user_id "
            f"ORDER BY {distance} LIMIT :limit"
            ") SELECT item_id, distance FROM found ORDER BY distance, item_id"
        ),
        {
            "q": literal(vector),
            "kind": kind,
            "tenant_id": tenant_id,
            "user_id": user_id,
            "limit": limit,
        },
    )
    return [(str(item_id), float(dist)) for item_id, dist in rows.all()]
