"""pgvector support: on a PostgreSQL that has it (the suite's own when it does,
else an embedded one, which ships pgvector), and on one that has not."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic import command
from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.db.migrate import alembic_config
from holdfast_shared.memory import vectors
from holdfast_shared.memory.embedders import WordLlamaEmbedder
from holdfast_shared.memory.vectors import VectorSupport
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.recall_set import corpus
from holdfast.testing import create_database, drop_database
from holdfast.testing.database import libpq_url
from tests.conftest import RUN_ID
from tests.servers import postgres_server

pytestmark = pytest.mark.timeout(180)

EMBEDDER = "test-embedder-256"


def has_pgvector(url: str) -> bool:
    with psycopg.connect(libpq_url(url), connect_timeout=10) as conn:
        found = conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'vector'")
        return found.fetchone() is not None


@pytest.fixture(scope="module")
def pgvector_server(postgres_url: str) -> Iterator[str]:
    """An admin URL of a PostgreSQL with pgvector."""
    if has_pgvector(postgres_url):
        yield postgres_url
        return
    with contextlib.ExitStack() as stack:
        # Not under pytest's base temp: the embedded server runs as another
        # user and opens the directories above its data for it, and any
        # pytest starting meanwhile on this machine closes pytest-of-<user>
        # again (0700), cutting the server off from its own files.
        directory = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="hftest-pgvector-", ignore_cleanup_errors=True)
        )
        with pytest.MonkeyPatch.context() as env:
            # The project's own discovery, forced to the embedded server.
            env.setenv("HOLDFAST_TEST_SERVERS", "embedded")
            try:
                url = stack.enter_context(postgres_server(Path(directory)))
            except Exception as exc:
                pytest.skip(f"no PostgreSQL with pgvector here, and no embedded one starts: {exc}")
        if not has_pgvector(url):
            pytest.skip("the embedded PostgreSQL has no pgvector")
        yield url


@pytest.fixture(scope="module")
def pgvector_url(pgvector_server: str) -> Iterator[str]:
    """A migrated database there: ``upgrade_head`` has installed the vectors."""
    name = f"hftest_{RUN_ID}_vectors"
    url = create_database(pgvector_server, name)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for tenant in ("tenant-a", "tenant-b"):
            conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (tenant, tenant))
    try:
        yield url
    finally:
        drop_database(pgvector_server, name)


@pytest.fixture
async def engine(pgvector_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_engine(pgvector_url, pool_size=2)
    yield engine
    await engine.dispose()


@pytest.fixture
async def support(engine: AsyncEngine) -> VectorSupport:
    async with engine.connect() as connection:
        return await vectors.probe(connection)


def unit(values: Sequence[float]) -> list[float]:
    length = math.sqrt(sum(x * x for x in values))
    return [x / length for x in values]


def random_unit(draw: random.Random, dims: int) -> list[float]:
    return unit([draw.gauss(0.0, 1.0) for _ in range(dims)])


def near(vector: Sequence[float], draw: random.Random, noise: float) -> list[float]:
    return unit([x + draw.gauss(0.0, noise) for x in vector])


class Statements:
    """Every statement the engine sends, with its parameters, to EXPLAIN later."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.seen: list[tuple[str, Any]] = []
        event.listen(engine.sync_engine, "before_cursor_execute", self._record)
        self._engine = engine

    def _record(self, conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        self.seen.append((statement, parameters))

    def close(self) -> None:
        event.remove(self._engine.sync_engine, "before_cursor_execute", self._record)

    def nearest(self) -> tuple[str, Any]:
        return next(s for s in reversed(self.seen) if "WITH found" in s[0])


async def explain(engine: AsyncEngine, statement: str, parameters: Any) -> str:
    """The plan of ``statement`` as a prepared statement's generic plan would be,
    the sequential scan priced out: does the index fit the statement?"""
    async with engine.connect() as connection:
        # On tables this small a sequential scan is as good; the point is that
        # the index is usable by the statement nearest() sends, with the plan
        # PostgreSQL settles on for a prepared statement (no parameter values).
        await connection.execute(text("SET LOCAL enable_seqscan = off"))
        await connection.execute(text("SET LOCAL plan_cache_mode = force_generic_plan"))
        rows = await connection.exec_driver_sql("EXPLAIN " + statement, parameters)
        return "\n".join(row[0] for row in rows)


# --- with pgvector ----------------------------------------------------------------


@pytest.mark.slow
async def test_install_is_idempotent_and_safe_to_run_at_once(
    pgvector_url: str, engine: AsyncEngine, support: VectorSupport
) -> None:
    engines = [create_engine(pgvector_url, pool_size=1) for _ in range(4)]
    try:
        results = await asyncio.gather(*(vectors.install(e) for e in engines))
        names = await asyncio.gather(
            *(vectors.ensure_index(e, "concurrent-embedder", 8, support) for e in engines)
        )
    finally:
        for e in engines:
            await e.dispose()
    assert all(r.available for r in results)
    assert len(set(names)) == 1 and names[0] is not None
    assert support.available and support.iterative_scan and support.halfvec
    assert support.to_json() == {"status": "ok", "pgvector": support.version}
    # And once more from synchronous code, as upgrade_head calls it.
    assert (await asyncio.to_thread(vectors.install_blocking, pgvector_url)).available


@pytest.mark.slow
async def test_the_schema_check_ignores_memory_vectors(
    pgvector_url: str, engine: AsyncEngine
) -> None:
    async with engine.connect() as connection:
        found = await connection.scalar(text("SELECT to_regclass('memory_vectors') IS NOT NULL"))
    assert found
    # Raises when autogenerate would drop the table the models do not know.
    await asyncio.to_thread(command.check, alembic_config(pgvector_url))


@pytest.mark.slow
async def test_nearest_finds_the_brains_own_memories(
    engine: AsyncEngine, support: VectorSupport
) -> None:
    embedder = WordLlamaEmbedder()
    await vectors.ensure_index(engine, embedder.name, embedder.dims, support)
    facts = corpus()
    vecs = await embedder.embed(facts)
    sessions = session_factory(engine)
    async with sessions.begin() as session:
        for brain, tenant, user, kind in (
            ("a", "tenant-a", "", "knowledge"),
            ("b", "tenant-b", "", "knowledge"),
            ("u", "tenant-a", "u1", "knowledge"),
            ("e", "tenant-a", "", "episodes"),
        ):
            rows = [(f"{brain}{i}", tenant, user, v) for i, v in enumerate(vecs)]
            await vectors.upsert_many(session, kind, embedder.name, rows)
    (query,) = await embedder.embed(["What's the name of my dog?"], purpose="query")
    async with sessions.begin() as session:
        found = await vectors.nearest(
            session, "knowledge", "tenant-a", "", embedder.name, query, 10, support=support
        )
    assert found[0][0] == "a0"  # "My dog is called Rex."
    assert len(found) == 10 and all(item.startswith("a") for item, _ in found)
    distances = [d for _, d in found]
    assert distances == sorted(distances) and 0 <= distances[0] < 1
    # Another embedder's vectors of the same items are never compared.
    async with sessions.begin() as session:
        assert (
            await vectors.nearest(
                session, "knowledge", "tenant-a", "", "other-256", query, 10, support=support
            )
            == []
        )


@pytest.mark.slow
async def test_nearest_uses_the_embedders_hnsw_index(
    engine: AsyncEngine, support: VectorSupport
) -> None:
    draw = random.Random(7)
    index = await vectors.ensure_index(engine, EMBEDDER, 256, support)
    assert index == vectors.index_name(EMBEDDER)
    sessions = session_factory(engine)
    async with sessions.begin() as session:
        rows = [(f"h{i}", "tenant-a", "", random_unit(draw, 256)) for i in range(300)]
        await vectors.upsert_many(session, "knowledge", EMBEDDER, rows)
    statements = Statements(engine)
    try:
        async with sessions.begin() as session:
            found = await vectors.nearest(
                session, "knowledge", "tenant-a", "", EMBEDDER, rows[42][3], 5, support=support
            )
    finally:
        statements.close()
    assert found[0][0] == "h42" and found[0][1] == pytest.approx(0.0, abs=1e-5)
    plan = await explain(engine, *statements.nearest())
    assert f"Index Scan using {index}" in plan, plan


@pytest.mark.slow
async def test_a_small_brain_is_found_among_many_others(
    engine: AsyncEngine, support: VectorSupport
) -> None:
    # Without an iterative scan the index would hand back the 40 nearest of
    # the whole table, all of another tenant, and the filter would leave none.
    draw = random.Random(11)
    target = random_unit(draw, 256)
    crowd = [(f"crowd{i}", "tenant-b", "", near(target, draw, 0.01)) for i in range(600)]
    mine = [(f"mine{i}", "tenant-a", "small", near(target, draw, 0.2)) for i in range(3)]
    await vectors.ensure_index(engine, EMBEDDER, 256, support)
    sessions = session_factory(engine)
    async with sessions.begin() as session:
        await vectors.upsert_many(session, "episodes", EMBEDDER, crowd + mine)
    async with sessions.begin() as session:
        await session.execute(text("SET LOCAL enable_seqscan = off"))
        found = await vectors.nearest(
            session, "episodes", "tenant-a", "small", EMBEDDER, target, 5, support=support
        )
    assert sorted(item for item, _ in found) == ["mine0", "mine1", "mine2"]


@pytest.mark.slow
async def test_large_vectors_are_indexed_as_halfvec(
    engine: AsyncEngine, support: VectorSupport
) -> None:
    draw = random.Random(3)
    name = "test-embedder-3072"
    index = await vectors.ensure_index(engine, name, 3072, support)
    assert index is not None
    sessions = session_factory(engine)
    async with sessions.begin() as session:
        rows = [(f"big{i}", "tenant-a", "", random_unit(draw, 3072)) for i in range(20)]
        await vectors.upsert_many(session, "knowledge", name, rows)
    statements = Statements(engine)
    try:
        async with sessions.begin() as session:
            found = await vectors.nearest(
                session, "knowledge", "tenant-a", "", name, rows[5][3], 3, support=support
            )
    finally:
        statements.close()
    assert found[0][0] == "big5"
    statement, parameters = statements.nearest()
    assert "halfvec(3072)" in statement
    assert f"Index Scan using {index}" in await explain(engine, statement, parameters)
    # Past pgvector's index limits the search is exact, and still answers.
    async with sessions.begin() as session:
        huge = random_unit(draw, 4500)
        await vectors.upsert(session, "knowledge", "huge", "tenant-a", "", "test-huge", huge)
        assert await vectors.ensure_index(engine, "test-huge", 4500, support) is None
        found = await vectors.nearest(
            session, "knowledge", "tenant-a", "", "test-huge", huge, 3, support=support
        )
    assert found == [("huge", pytest.approx(0.0, abs=1e-5))]


@pytest.mark.slow
async def test_upsert_replaces_zero_removes_and_deletes_follow_the_brain(
    engine: AsyncEngine, support: VectorSupport
) -> None:
    draw = random.Random(5)
    first, second = random_unit(draw, 256), random_unit(draw, 256)
    sessions = session_factory(engine)

    async def nearest_of(vector: Sequence[float], user: str = "z") -> list[str]:
        async with sessions.begin() as session:
            found = await vectors.nearest(
                session, "social", "tenant-a", user, EMBEDDER, vector, 10, support=support
            )
        return [item for item, _ in found]

    async with sessions.begin() as session:
        await vectors.upsert(session, "social", "p1", "tenant-a", "z", EMBEDDER, first)
        await vectors.upsert(session, "social", "p1", "tenant-a", "z", EMBEDDER, second)
        await vectors.upsert(session, "social", "p2", "tenant-a", "z", EMBEDDER, first)
        await vectors.upsert(session, "social", "p3", "tenant-a", "y", EMBEDDER, first)
    assert await nearest_of(second) == ["p1", "p2"]
    assert await nearest_of([0.0] * 256) == []
    async with sessions.begin() as session:
        # A text with nothing to embed: nothing to find it by.
        await vectors.upsert(session, "social", "p1", "tenant-a", "z", EMBEDDER, [0.0] * 256)
    assert await nearest_of(second) == ["p2"]
    async with sessions.begin() as session:
        assert await vectors.delete(session, "social", ["p2"]) == 1
        assert await vectors.delete_brain(session, "tenant-a", "y") == 1
    assert await nearest_of(first) == [] and await nearest_of(first, "y") == []
    with pytest.raises(ValueError, match="embedder name"):
        async with sessions.begin() as session:
            await vectors.upsert(session, "social", "p", "tenant-a", "", "bad'name", first)


# --- without pgvector ---------------------------------------------------------------


async def test_without_pgvector_nothing_fails_and_health_says_why(database_url: str) -> None:
    if has_pgvector(database_url):
        pytest.skip("this PostgreSQL has pgvector; the missing-extension path needs one without")
    # The session's database was migrated already (upgrade_head ran install) …
    engine = create_engine(database_url, pool_size=1)
    try:
        support = await vectors.install(engine)
        async with engine.connect() as connection:
            probed = await vectors.probe(connection)
            table = await connection.scalar(text("SELECT to_regclass('memory_vectors')"))
    finally:
        await engine.dispose()
    # … and neither that nor another install raised.
    blocking = await asyncio.to_thread(vectors.install_blocking, database_url)
    for result in (support, probed, blocking):
        assert not result.available
        assert result.reason == vectors.MISSING
        assert not result.halfvec and not result.iterative_scan
    assert support.to_json() == {
        "status": "unavailable",
        "reason": "pgvector extension not installed in this PostgreSQL; "
        "retrieval uses full text only",
    }
    assert table is None


def test_embedder_names_are_safe_as_sql_literals() -> None:
    for good in ("wordllama-l2_supercat-256", "openai:text-embedding-3-large@256", "a/b+c.d"):
        assert len(vectors.index_name(good)) <= 63
    # Names that read alike still get indexes of their own.
    assert vectors.index_name("a-b") != vectors.index_name("a_b")
