"""The vector side of a brain: embeddings written with the rows, searched with full text.

:class:`MemoryIndex` joins an embedder (``embedders.py``) and pgvector
(``vectors.py``). Every writer of memories — the learning centre, the
``memory_save`` tool, the HTTP API, an import — calls :meth:`add` in the
transaction that writes the rows, so a row and its vector commit together;
:class:`~holdfast_shared.memory.search.Searcher` calls :meth:`nearest`.

:func:`open_index` returns None where there is nothing to do: no embedder
configured (``HOLDFAST_EMBEDDER=none``) or no pgvector in this PostgreSQL.
Search is then full text alone, and ``/health`` says why.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from holdfast_shared.db.models import Entity, Episode, Fact
from holdfast_shared.memory import vectors
from holdfast_shared.memory.brain import Brain
from holdfast_shared.memory.embedders import Embedder
from holdfast_shared.memory.search import Kind

log = logging.getLogger(__name__)


# Query vectors kept: one search asks for each kind with the same query, and a
# remote embedder would otherwise be called once per kind.
_QUERIES_KEPT = 64


@dataclass
class MemoryIndex:
    embedder: Embedder
    support: vectors.VectorSupport
    _queries: OrderedDict[str, list[float]] = field(default_factory=OrderedDict)

    async def _query_vector(self, query: str) -> list[float]:
        vector = self._queries.get(query)
        if vector is None:
            (vector,) = await self.embedder.embed([query], purpose="query")
            self._queries[query] = vector
            while len(self._queries) > _QUERIES_KEPT:
                self._queries.popitem(last=False)
        return vector

    async def add(
        self,
        session: AsyncSession,
        brain: Brain,
        kind: Kind,
        items: Sequence[tuple[str, str]],
    ) -> None:
        """Embed and store ``(item_id, text)`` pairs of one kind (replacing older vectors)."""
        if not items:
            return
        embedded = await self.embedder.embed([text for _, text in items], purpose="document")
        await vectors.upsert_many(
            session,
            kind,
            self.embedder.name,
            [
                (item_id, brain.tenant_id, brain.user_id, vector)
                for (item_id, _), vector in zip(items, embedded, strict=True)
            ],
        )

    async def add_ids(
        self, session: AsyncSession, brain: Brain, kind: Kind, item_ids: Sequence[str]
    ) -> None:
        """:meth:`add` for rows of ``brain`` known by id (their text is read here)."""
        if item_ids:
            await self.add(session, brain, kind, await _texts(session, brain, kind, item_ids))

    async def remove(self, session: AsyncSession, kind: Kind, item_ids: Sequence[str]) -> None:
        await vectors.delete(session, kind, item_ids)

    async def forget(self, session: AsyncSession, brain: Brain) -> None:
        await vectors.delete_brain(session, brain.tenant_id, brain.user_id)

    async def nearest(
        self, session: AsyncSession, brain: Brain, kind: Kind, query: str, limit: int
    ) -> list[str]:
        vector = await self._query_vector(query)
        found = await vectors.nearest(
            session,
            kind,
            brain.tenant_id,
            brain.user_id,
            self.embedder.name,
            vector,
            limit,
            support=self.support,
        )
        return [item_id for item_id, _distance in found]


def entity_text(entity: Entity) -> str:
    """What an entity's vector is made of."""
    return f"{entity.name} ({entity.kind}) {entity.description}".strip()


async def _texts(
    session: AsyncSession, brain: Brain, kind: Kind, item_ids: Sequence[str]
) -> list[tuple[str, str]]:
    model: type[Fact] | type[Episode] | type[Entity]
    if kind == "knowledge":
        model = Fact
    elif kind == "episodes":
        model = Episode
    else:
        model = Entity
    rows = (
        await session.execute(
            select(model).where(
                model.id.in_(list(item_ids)),
                model.tenant_id == brain.tenant_id,
                model.user_id == brain.user_id,
            )
        )
    ).scalars()
    found: list[tuple[str, str]] = []
    for row in rows:
        if isinstance(row, Entity):
            found.append((row.id, entity_text(row)))
        elif isinstance(row, Fact | Episode):
            found.append((row.id, row.text))
    return found


async def open_index(engine: AsyncEngine, embedder: Embedder | None) -> MemoryIndex | None:
    """The index for this database and embedder, or None (full text alone)."""
    async with engine.connect() as connection:
        support = await vectors.probe(connection)
    if embedder is None:
        return None
    if not support.available:
        log.warning("memory: %s", support.reason)
        return None
    await vectors.ensure_index(engine, embedder.name, embedder.dims, support)
    return MemoryIndex(embedder, support)
