"""Finding memories again: full text always, vectors where there are some, fused.

Each kind (knowledge, episodes, social) is searched on its own: PostgreSQL
full-text search over the row's generated ``tsv`` (rows sharing two or more
words with the query first, then rows sharing one: see ``_full_text``) and, when a
:class:`Nearest` is given (pgvector installed and an embedder configured),
the nearest vectors. The two rankings are fused by reciprocal rank fusion
(RRF): a row's score is the sum of ``1 / (RRF_K + rank)`` over the lists it
appears in, so neither ranking's raw scores need to be comparable.

Only current facts are found (a superseded one is history, reachable from
the fact that replaced it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol, TypeVar

from sqlalchemy import ColumnElement, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.db.models import Entity, Episode, Fact, Relation
from holdfast_shared.memory.brain import Brain

Kind = Literal["knowledge", "episodes", "social"]
KINDS: tuple[Kind, ...] = ("knowledge", "episodes", "social")

# The constant of reciprocal rank fusion (Cormack et al.): dampens the top ranks.
RRF_K = 60
# Each ranking contributes this many candidates per kind before fusion.
_CANDIDATES = 20
# Full text ranks at most this many matching rows per stage (see _full_text).
_RANKED = 500
# Words of a query that count (the pairs of them make the first stage).
_MAX_TERMS = 12


@dataclass(frozen=True, slots=True)
class Hit:
    id: str
    kind: Kind
    text: str
    score: float
    created_at: datetime
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "text": self.text,
            "score": round(self.score, 6),
            "created_at": self.created_at.isoformat(),
            **self.extra,
        }


class Nearest(Protocol):
    """Vector similarity search (memory/index.py), when it is available."""

    async def nearest(
        self, session: AsyncSession, brain: Brain, kind: Kind, query: str, limit: int
    ) -> list[str]:
        """Ids of the ``limit`` rows of ``kind`` nearest to ``query``, nearest first."""
        ...


def _fused(rankings: Sequence[Sequence[str]]) -> list[tuple[str, float]]:
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, item_id in enumerate(ranking, start=1):
            scores[item_id] = scores.get(item_id, 0.0) + 1.0 / (RRF_K + rank)
    return sorted(scores.items(), key=lambda pair: -pair[1])


class Searcher:
    """Search one brain's memories."""

    def __init__(self, nearest: Nearest | None = None) -> None:
        self.vectors = nearest

    async def search(
        self,
        session: AsyncSession,
        brain: Brain,
        query: str,
        *,
        kinds: Sequence[Kind] = KINDS,
        limit: int = 10,
    ) -> list[Hit]:
        """The best ``limit`` hits; several kinds are interleaved by their fused rank.

        One statement finds the full-text candidates of every kind, then one
        per kind loads the hits: a turn's retrieval is a handful of round trips.
        """
        if not query.strip():
            return []
        want = max(limit, _CANDIDATES)
        by_text = await _full_text(session, brain, kinds, query, want)
        per_kind: list[list[Hit]] = []
        for kind in kinds:
            rankings = [by_text.get(kind, [])]
            if self.vectors is not None:
                rankings.append(await self.vectors.nearest(session, brain, kind, query, want))
            fused = _fused(rankings)[:limit]
            rows = await _load(session, brain, kind, [item_id for item_id, _ in fused])
            per_kind.append(
                [rows[item_id].with_score(score) for item_id, score in fused if item_id in rows]
            )
        if len(per_kind) == 1:
            return per_kind[0]
        merged: list[Hit] = []
        for rank in range(limit):
            merged.extend(hits[rank] for hits in per_kind if rank < len(hits))
        return merged[:limit]


# Full text in one statement for every kind asked. ``units`` are the query's
# stemmed, stop-word-free lexemes as plainto_tsquery gives them (a hyphenated
# word stays one phrase unit, already quoted as tsquery syntax); ``any_q``
# matches rows holding any of them, ``pairs_q`` rows holding two or more
# (``any_q`` again for a one-word query). No words left: NULL, no rows.
_TERMS = f"""
WITH units AS (
    SELECT DISTINCT unit
    FROM unnest(string_to_array(plainto_tsquery('english', :q)::text, ' & ')) AS unit
    WHERE unit <> '' LIMIT {_MAX_TERMS}
), terms AS (
    SELECT (SELECT string_agg('(' || unit || ')', ' | ') FROM units)::tsquery AS any_q,
           coalesce(
               (SELECT string_agg('(' || a.unit || ' & ' || b.unit || ')', ' | ')
                FROM units a JOIN units b ON a.unit < b.unit),
               (SELECT string_agg('(' || unit || ')', ' | ') FROM units)
           )::tsquery AS pairs_q
)
"""
# One stage of one kind: the best :limit of a bounded sample of the matches.
_STAGE = """
(SELECT '{kind}' AS kind, id, {stage} AS stage,
        ts_rank(tsv, (SELECT any_q FROM terms), 1) AS rank
 FROM (SELECT id, tsv FROM {table}
       WHERE tenant_id = :tenant AND user_id = :user {current}
         AND tsv @@ (SELECT {match} FROM terms)
       LIMIT {ranked}) AS sample
 ORDER BY rank DESC, id DESC LIMIT :limit)
"""
_TABLES: dict[Kind, tuple[str, str]] = {
    "knowledge": ("memory_facts", "AND valid_to IS NULL"),
    "episodes": ("memory_episodes", ""),
    "social": ("memory_entities", ""),
}


async def _full_text(
    session: AsyncSession, brain: Brain, kinds: Sequence[Kind], query: str, limit: int
) -> dict[Kind, list[str]]:
    """Per kind: rows sharing two or more words with the query, best first;
    then, to fill ``limit``, rows sharing one.

    PostgreSQL ranks every row a query matches, and one common word can match
    a large share of a big brain: each stage ranks a bounded sample of its
    matches (``_RANKED``). Rows sharing two words with the query are few, so
    that stage is exact in practice; the one-word stage is a fallback.
    (Normalisation 1 of ``ts_rank``: long rows do not win by length alone.)
    """
    stages = [
        _STAGE.format(
            kind=kind, stage=stage, table=table, current=current, match=match, ranked=_RANKED
        )
        for kind in kinds
        for table, current in (_TABLES[kind],)
        for stage, match in ((0, "pairs_q"), (1, "any_q"))
    ]
    statement = (
        _TERMS
        + "SELECT kind, id FROM ("
        + " UNION ALL ".join(stages)
        + ") AS found ORDER BY kind, stage, rank DESC, id DESC"
    )
    result = await session.execute(
        text(statement),
        {"q": query, "tenant": brain.tenant_id, "user": brain.user_id, "limit": limit},
    )
    ranked: dict[Kind, list[str]] = {}
    for kind, item_id in result.all():
        ids = ranked.setdefault(kind, [])
        if item_id not in ids and len(ids) < limit:
            ids.append(item_id)
    return ranked


_MODELS: dict[Kind, type[Fact] | type[Episode] | type[Entity]] = {
    "knowledge": Fact,
    "episodes": Episode,
    "social": Entity,
}


@dataclass(frozen=True, slots=True)
class _Row:
    id: str
    kind: Kind
    text: str
    created_at: datetime
    extra: dict[str, Any]

    def with_score(self, score: float) -> Hit:
        return Hit(self.id, self.kind, self.text, score, self.created_at, self.extra)


_Memory = TypeVar("_Memory", Fact, Episode, Entity)


async def _of_brain(
    session: AsyncSession,
    model: type[_Memory],
    brain: Brain,
    ids: list[str],
    *also: ColumnElement[bool],
) -> list[_Memory]:
    """The rows of ``model`` among ``ids`` that are ``brain``'s (and match ``also``)."""
    statement = select(model).where(
        model.id.in_(ids),
        model.tenant_id == brain.tenant_id,
        model.user_id == brain.user_id,
        *also,
    )
    return list(await session.scalars(statement))


async def _load(session: AsyncSession, brain: Brain, kind: Kind, ids: list[str]) -> dict[str, _Row]:
    """The rows behind ``ids`` (of ``brain`` only), rendered as hits."""
    if not ids:
        return {}  # nothing of this kind matched: no round trip
    if kind == "knowledge":
        facts = await _of_brain(session, Fact, brain, ids, Fact.valid_to.is_(None))
        return {f.id: _Row(f.id, kind, f.text, f.created_at, fact_extra(f)) for f in facts}
    if kind == "episodes":
        episodes = await _of_brain(session, Episode, brain, ids)
        return {e.id: _Row(e.id, kind, e.text, e.created_at, episode_extra(e)) for e in episodes}
    entities = await _of_brain(session, Entity, brain, ids)
    edges = await relations_of(session, [e.id for e in entities])
    return {
        e.id: _Row(
            e.id,
            kind,
            render_entity(e, edges.get(e.id, [])),
            e.created_at,
            {
                "name": e.name,
                "entity_kind": e.kind,
                "relations": edges.get(e.id, []),
            },
        )
        for e in entities
    }


def fact_extra(fact: Fact) -> dict[str, Any]:
    return {
        "key": fact.key,
        "confidence": round(fact.confidence, 4),
        "sources": fact.sources,
        "valid_from": fact.valid_from.isoformat(),
        "valid_to": fact.valid_to.isoformat() if fact.valid_to else None,
        "superseded_by": fact.superseded_by,
    }


def episode_extra(episode: Episode) -> dict[str, Any]:
    return {
        "task_id": episode.task_id,
        "trajectory_id": episode.trajectory_id,
        "outcome": episode.outcome,
        "participants": episode.participants,
        "occurred_at": episode.occurred_at.isoformat(),
    }


async def relations_of(
    session: AsyncSession, entity_ids: Sequence[str]
) -> dict[str, list[dict[str, str]]]:
    """Each entity's edges, both ways: ``{"relation", "direction", "name", "kind", "id"}``."""
    if not entity_ids:
        return {}
    source = Entity.__table__.alias("source")
    target = Entity.__table__.alias("target")
    rows = (
        await session.execute(
            select(
                Relation.relation,
                source.c.id,
                source.c.name,
                source.c.kind,
                target.c.id,
                target.c.name,
                target.c.kind,
            )
            .join(source, source.c.id == Relation.source_id)
            .join(target, target.c.id == Relation.target_id)
            .where(or_(Relation.source_id.in_(entity_ids), Relation.target_id.in_(entity_ids)))
            .order_by(Relation.created_at)
        )
    ).all()
    edges: dict[str, list[dict[str, str]]] = {}
    for relation, sid, sname, skind, tid, tname, tkind in rows:
        edges.setdefault(sid, []).append(
            {"relation": relation, "direction": "out", "id": tid, "name": tname, "kind": tkind}
        )
        edges.setdefault(tid, []).append(
            {"relation": relation, "direction": "in", "id": sid, "name": sname, "kind": skind}
        )
    return edges


def render_entity(entity: Entity, edges: Sequence[dict[str, str]]) -> str:
    """One line a model can read: who or what it is and how it relates to others."""
    line = f"{entity.name} ({entity.kind})"
    if entity.description:
        line += f": {entity.description}"
    links = [
        f"{e['relation'].replace('_', ' ')} {e['name']}"
        if e["direction"] == "out"
        else f"{e['name']} {e['relation'].replace('_', ' ')} {entity.name}"
        for e in edges[:8]
    ]
    if links:
        line += " — " + "; ".join(links)
    return line
