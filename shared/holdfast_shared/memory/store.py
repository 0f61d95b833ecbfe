"""Writing a brain: facts with history, episodes, the social graph, the soul.

Nothing here overwrites silently. A fact told again *merges* into the one on
record (its sources grow, its confidence rises); a fact that contradicts a
current one about the same thing (same ``key``) *supersedes* it: the old row
is closed (``valid_to``, ``superseded_by``) and stays as history. The soul is
versioned: each revision is a new row.

Writes to one brain are serialised by a transaction-scoped advisory lock
(:func:`lock_brain`), so two learners merging the same fact at once cannot
both create it. Callers own the transaction.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import case, delete, func, or_, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.db.models import (
    Entity,
    Episode,
    Fact,
    Relation,
    SoulVersion,
    TrajectoryRecord,
)
from holdfast_shared.ids import new_id
from holdfast_shared.memory.brain import Brain

MAX_FACT_CHARS = 2000
MAX_SOUL_CHARS = 20_000
ENTITY_KINDS = ("person", "organisation", "project", "place", "other")

_SPACE = re.compile(r"\s+")
_TRAILING = re.compile(r"[\s.!;,]+$")


def normalize(value: str) -> str:
    """What makes two statements "the same": case, spacing and end punctuation folded."""
    return _TRAILING.sub("", _SPACE.sub(" ", value.strip().casefold()))


def _merged_confidence(old: float, new: float) -> float:
    # Independent confirmations: the chance both are wrong shrinks.
    return min(0.99, 1 - (1 - old) * (1 - new))


async def lock_brain(session: AsyncSession, brain: Brain) -> None:
    """Serialise writes to one brain until the transaction ends (once per transaction)."""
    digest = hashlib.blake2b(f"{brain.tenant_id}\0{brain.user_id}".encode(), digest_size=8).digest()
    key = int.from_bytes(digest, "big", signed=True)
    # The session's own record of the locks its transaction holds: asking
    # again would only cost a round trip.
    held: dict[object, set[int]] = session.info.setdefault("brain_locks", {})
    transaction = session.get_transaction()
    if key in held.get(transaction, set()):
        return
    await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})
    held.clear()  # an earlier transaction's locks are gone with it
    held.setdefault(transaction, set()).add(key)


# -- knowledge -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FactChange:
    """What saving a fact did: ``fact`` is the current row afterwards.

    ("merged" with a ``previous`` means the statement was older than the
    current fact it contradicts: it was stored as that fact's history.)
    """

    action: Literal["created", "merged", "superseded"]
    fact: Fact
    previous: Fact | None = None


@dataclass(frozen=True, slots=True)
class NewFact:
    """A statement to record, as an extractor or a caller gives it."""

    text: str
    key: str | None = None
    confidence: float = 0.8


async def save_fact(
    session: AsyncSession,
    brain: Brain,
    statement: str,
    *,
    source: str,
    key: str | None = None,
    confidence: float = 0.8,
    at: datetime | None = None,
) -> FactChange:
    """Record ``statement`` in ``brain``: create it, merge it, or supersede what it contradicts."""
    (change,) = await save_facts(
        session, brain, [NewFact(statement, key, confidence)], source=source, at=at
    )
    return change


async def save_facts(
    session: AsyncSession,
    brain: Brain,
    facts: Sequence[NewFact],
    *,
    source: str,
    at: datetime | None = None,
) -> list[FactChange]:
    """:func:`save_fact` for several statements, in order, with one lookup and one flush."""
    now = at or datetime.now(UTC)
    items = [
        NewFact(
            f.text.strip()[:MAX_FACT_CHARS],
            (f.key or "").strip().casefold()[:200] or None,
            min(max(f.confidence, 0.0), 1.0),
        )
        for f in facts
    ]
    if not items:
        return []
    await lock_brain(session, brain)
    norms = {normalize(f.text) for f in items}
    keys = {f.key for f in items if f.key}
    # The same statements, and the current facts about the same things, in one lookup.
    same = Fact.norm.in_(norms) if not keys else or_(Fact.norm.in_(norms), Fact.key.in_(keys))
    found = (
        await session.execute(
            select(Fact)
            .where(
                Fact.tenant_id == brain.tenant_id,
                Fact.user_id == brain.user_id,
                Fact.valid_to.is_(None),
                same,
            )
            .order_by(Fact.valid_from)
        )
    ).scalars()
    by_norm: dict[str, Fact] = {}
    by_key: dict[str, Fact] = {}
    for fact in found:
        by_norm[fact.norm] = fact
        if fact.key:
            by_key[fact.key] = fact  # the newest wins (ordered oldest first)
    changes = [_save_one(session, brain, item, source, now, by_norm, by_key) for item in items]
    # Updates are flushed before inserts, so a closed row never meets its successor
    # in the "one current row per statement" index.
    await session.flush()
    return changes


def _save_one(
    session: AsyncSession,
    brain: Brain,
    item: NewFact,
    source: str,
    now: datetime,
    by_norm: dict[str, Fact],
    by_key: dict[str, Fact],
) -> FactChange:
    norm = normalize(item.text)
    current = by_norm.get(norm)
    if current is not None:
        if source not in current.sources:
            current.sources = [*current.sources, source]
        current.confidence = _merged_confidence(current.confidence, item.confidence)
        current.updated_at = now
        if item.key and not current.key:
            current.key = item.key
            by_key[item.key] = current
        return FactChange("merged", current)
    contradicted = by_key.get(item.key) if item.key else None
    fact = Fact(
        id=new_id("fact"),
        tenant_id=brain.tenant_id,
        user_id=brain.user_id,
        text=item.text,
        norm=norm,
        key=item.key,
        confidence=item.confidence,
        sources=[source],
        valid_from=now,
        created_at=now,
        updated_at=now,
    )
    session.add(fact)
    if contradicted is not None and contradicted.valid_from > now:
        # Learned late (a retried trajectory): what it says was already replaced
        # by something newer, so it enters the history, not the present.
        fact.valid_to = contradicted.valid_from
        fact.superseded_by = contradicted.id
        return FactChange("merged", contradicted, fact)
    by_norm[norm] = fact
    if item.key:
        by_key[item.key] = fact
    if contradicted is None:
        return FactChange("created", fact)
    contradicted.valid_to = now
    contradicted.superseded_by = fact.id
    contradicted.updated_at = now
    del by_norm[contradicted.norm]
    return FactChange("superseded", fact, contradicted)


async def get_fact(session: AsyncSession, brain: Brain, fact_id: str) -> Fact | None:
    return (
        await session.execute(
            select(Fact).where(
                Fact.id == fact_id,
                Fact.tenant_id == brain.tenant_id,
                Fact.user_id == brain.user_id,
            )
        )
    ).scalar_one_or_none()


async def fact_history(session: AsyncSession, fact: Fact) -> list[Fact]:
    """The versions ``fact`` superseded (directly or through older versions), newest first."""
    chain: list[Fact] = []
    frontier = [fact.id]
    # A chain is short (one row per change of mind); each step is one indexed lookup.
    for _ in range(1000):
        older = list(
            (
                await session.execute(
                    select(Fact).where(
                        Fact.tenant_id == fact.tenant_id,
                        Fact.user_id == fact.user_id,
                        Fact.superseded_by.in_(frontier),
                    )
                )
            ).scalars()
        )
        if not older:
            break
        chain.extend(older)
        frontier = [f.id for f in older]
    return sorted(chain, key=lambda f: f.valid_from, reverse=True)


async def delete_fact(session: AsyncSession, brain: Brain, fact_id: str) -> bool:
    """Forget a fact (and the history it superseded); False when there is none."""
    fact = await get_fact(session, brain, fact_id)
    if fact is None:
        return False
    ids = [fact.id, *(older.id for older in await fact_history(session, fact))]
    await session.execute(delete(Fact).where(Fact.id.in_(ids)))
    # A newer version pointing here keeps standing on its own.
    await session.execute(
        update(Fact).where(Fact.superseded_by.in_(ids)).values(superseded_by=None)
    )
    return True


# -- episodes --------------------------------------------------------------------
async def add_episode(
    session: AsyncSession,
    brain: Brain,
    *,
    summary: str,
    occurred_at: datetime,
    trajectory_id: str | None = None,
    task_id: str | None = None,
    outcome: str | None = None,
    participants: Sequence[str] = (),
) -> Episode | None:
    """Record an episode; None when the trajectory already has one (learned twice)."""
    episode_id = new_id("ep")
    statement = (
        insert(Episode)
        .values(
            id=episode_id,
            tenant_id=brain.tenant_id,
            user_id=brain.user_id,
            task_id=task_id,
            trajectory_id=trajectory_id,
            text=summary.strip()[: MAX_FACT_CHARS * 4],
            outcome=(outcome or None) and outcome[:200],
            participants=list(dict.fromkeys(participants)),
            occurred_at=occurred_at,
        )
        .on_conflict_do_nothing(index_elements=[Episode.trajectory_id])
        .returning(Episode)
    )
    result = await session.execute(select(Episode).from_statement(statement))
    return result.scalar_one_or_none()


# -- the social graph ------------------------------------------------------------
def _with_evidence(column: Any, evidence: str) -> Any:
    """``column`` (a JSON array) with ``evidence`` appended unless it holds it already."""
    return case(
        (column.op("?")(evidence), column),
        else_=column.op("||")(func.jsonb_build_array(evidence)),
    )


async def upsert_entity(
    session: AsyncSession,
    brain: Brain,
    name: str,
    kind: str,
    *,
    description: str = "",
    evidence: str,
) -> Entity:
    """The entity named ``name`` of ``kind``, created or with ``evidence`` added.

    A longer description replaces a shorter one: later mentions tend to know more.
    One statement either way.
    """
    kind = kind if kind in ENTITY_KINDS else "other"
    name = _SPACE.sub(" ", name.strip())[:300]
    description = description.strip()[:MAX_FACT_CHARS]
    now = datetime.now(UTC)
    table = Entity.__table__
    statement = (
        insert(Entity)
        .values(
            id=new_id("ent"),
            tenant_id=brain.tenant_id,
            user_id=brain.user_id,
            name=name,
            norm=normalize(name)[:300],
            kind=kind,
            description=description,
            evidence=[evidence],
            created_at=now,
            updated_at=now,
        )
        .on_conflict_do_update(
            constraint="uq_memory_entities_name",
            set_={
                "evidence": _with_evidence(table.c.evidence, evidence),
                "description": case(
                    (
                        func.length(insert(Entity).excluded.description)
                        > func.length(table.c.description),
                        insert(Entity).excluded.description,
                    ),
                    else_=table.c.description,
                ),
                "updated_at": now,
            },
        )
        .returning(Entity)
    )
    result = await session.execute(
        select(Entity).from_statement(statement), execution_options={"populate_existing": True}
    )
    entity: Entity = result.scalar_one()
    return entity


async def add_relation(
    session: AsyncSession,
    brain: Brain,
    source: Entity,
    relation: str,
    target: Entity,
    *,
    evidence: str,
) -> Relation:
    """The edge ``source —relation→ target``, created or with ``evidence`` added (one statement)."""
    relation = _SPACE.sub("_", relation.strip().casefold())[:100] or "related_to"
    statement = (
        insert(Relation)
        .values(
            id=new_id("rel"),
            tenant_id=brain.tenant_id,
            user_id=brain.user_id,
            source_id=source.id,
            relation=relation,
            target_id=target.id,
            evidence=[evidence],
        )
        .on_conflict_do_update(
            constraint="uq_memory_relations_edge",
            set_={"evidence": _with_evidence(Relation.__table__.c.evidence, evidence)},
        )
        .returning(Relation)
    )
    result = await session.execute(
        select(Relation).from_statement(statement), execution_options={"populate_existing": True}
    )
    edge: Relation = result.scalar_one()
    return edge


# -- the soul --------------------------------------------------------------------
async def current_soul(session: AsyncSession, brain: Brain) -> SoulVersion | None:
    return (
        await session.execute(
            select(SoulVersion)
            .where(SoulVersion.tenant_id == brain.tenant_id, SoulVersion.user_id == brain.user_id)
            .order_by(SoulVersion.version.desc())
            .limit(1)
        )
    ).scalar_one_or_none()


async def revise_soul(
    session: AsyncSession,
    brain: Brain,
    content: str,
    *,
    source: str,
    trajectory_id: str | None = None,
) -> SoulVersion:
    """A new version of the soul (the same content as the current one: nothing new)."""
    await lock_brain(session, brain)
    content = content.strip()[:MAX_SOUL_CHARS]
    current = await current_soul(session, brain)
    if current is not None and current.content == content:
        return current
    version = SoulVersion(
        tenant_id=brain.tenant_id,
        user_id=brain.user_id,
        version=(current.version if current else 0) + 1,
        content=content,
        source=source,
        trajectory_id=trajectory_id,
        created_at=datetime.now(UTC),
    )
    session.add(version)
    await session.flush()
    return version


# -- forgetting ------------------------------------------------------------------
async def forget(session: AsyncSession, brain: Brain) -> dict[str, int]:
    """Delete everything the brain holds (and the trajectories it was learned from)."""
    await lock_brain(session, brain)
    counts: dict[str, int] = {}
    for name, model in (
        ("relations", Relation),
        ("entities", Entity),
        ("knowledge", Fact),
        ("episodes", Episode),
        ("soul_versions", SoulVersion),
        ("trajectories", TrajectoryRecord),
    ):
        result = await session.execute(
            delete(model).where(
                model.tenant_id == brain.tenant_id,
                model.user_id == brain.user_id,
            )
        )
        counts[name] = result.rowcount or 0  # type: ignore[attr-defined]
    return counts


async def count_current_facts(session: AsyncSession, brain: Brain) -> int:
    return int(
        (
            await session.execute(
                select(func.count())
                .select_from(Fact)
                .where(
                    Fact.tenant_id == brain.tenant_id,
                    Fact.user_id == brain.user_id,
                    Fact.valid_to.is_(None),
                )
            )
        ).scalar_one()
    )
