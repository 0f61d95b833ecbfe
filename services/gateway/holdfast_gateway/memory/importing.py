"""Importing a brain's NDJSON (``transfer.py``): all or nothing, upserted by id.

:func:`import_lines` writes lines :func:`transfer.parse` accepted into the
brain it is given, whatever tenant and user the lines name, in the caller's
transaction:

* Rows are upserted by id (souls by version), and a row already as its line
  says is left untouched: importing a file twice changes nothing the second
  time, and export → forget → import → export gives the same bytes.
* Lines from another brain (their ``tenant_id``/``user_id`` differ from the
  target's) get their ids — and the ids they refer to: relation ends,
  ``superseded_by``, an episode's ``trajectory_id`` — mapped to ids derived
  from the target brain and the original (:func:`derived_id`): a copy never
  touches the original's rows, and importing it again finds the same ids.
  So does a line of this brain whose id another brain holds.
* Before anything is written, every line is checked against the brain: a
  row must not collide with a different row of it (a second current fact of
  the same text or key, a second fact superseded by the same one, an entity
  of the same kind and name, the same relation twice, a second episode of
  one trajectory: ``conflict``), and a relation's ends must be entities of
  the file or the brain (``unknown_entity``). Any problem raises
  :class:`transfer.ImportRefused` and nothing is written.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from holdfast_shared.db.models import Entity, Episode, Fact, Relation, SoulVersion
from holdfast_shared.memory.brain import Brain
from holdfast_shared.memory.store import lock_brain, normalize
from sqlalchemy import (
    ARRAY,
    Text,
    and_,
    any_,
    cast,
    func,
    literal,
    literal_column,
    not_,
    or_,
    select,
    tuple_,
)
from sqlalchemy.dialects.postgresql import JSONB, insert
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway.memory.transfer import (
    LINE_KINDS,
    EntityLine,
    EpisodeLine,
    FactLine,
    ImportRefused,
    Line,
    LineError,
    Numbered,
    RelationLine,
    Row,
    SoulLine,
    entity_norm,
    fact_key,
    of_kind,
)


def derived_id(brain: Brain, original: str) -> str:
    """The id that a row (or a reference) ``original`` of another brain gets in ``brain``.

    The same every time, so a copy imported again finds its rows; it keeps
    the original's prefix (``fact_``, ``ent_``...).
    """
    prefix, separator, _ = original.partition("_")
    digest = hashlib.blake2b(
        f"{brain.tenant_id}\0{brain.user_id}\0{original}".encode(), digest_size=16
    ).hexdigest()
    return f"{prefix[:24]}_{digest}" if separator else digest


def _counts() -> dict[str, int]:
    return dict.fromkeys(LINE_KINDS, 0)


@dataclass
class ImportResult:
    """How many rows of each kind the import created, changed, or found as the lines say."""

    lines: int = 0
    created: dict[str, int] = field(default_factory=_counts)
    updated: dict[str, int] = field(default_factory=_counts)
    unchanged: dict[str, int] = field(default_factory=_counts)
    # Ids of the facts, episodes and entities created or changed: what the
    # vector index must (re)embed.
    written: dict[str, list[str]] = field(
        default_factory=lambda: {"fact": [], "episode": [], "entity": []}
    )

    def to_json(self) -> dict[str, Any]:
        return {
            "lines": self.lines,
            "created": self.created,
            "updated": self.updated,
            "unchanged": self.unchanged,
        }


_RowModel = type[Fact] | type[Episode] | type[Entity] | type[Relation]
_ROW_MODELS: dict[str, _RowModel] = {
    "fact": Fact,
    "episode": Episode,
    "entity": Entity,
    "relation": Relation,
}


class _Plan:
    """Where each line's row goes in the brain: its id, and what stops it."""

    def __init__(self, brain: Brain, lines: Sequence[Numbered]) -> None:
        self.brain = brain
        self.lines = lines
        self.errors: list[LineError] = []
        # kind -> id in the file -> id in the brain
        self.ids: dict[str, dict[str, str]] = {kind: {} for kind in _ROW_MODELS}
        # trajectory id in the file -> in the brain
        self.trajectories: dict[str, str] = {}

    def ours(self, line: Line) -> bool:
        """Whether ``line`` came from this brain (a line naming none did)."""
        brain = self.brain
        return line.tenant_id in (None, brain.tenant_id) and line.user_id in (None, brain.user_id)

    def reference(self, kind: str, original: str, line: Line) -> str:
        """The id in this brain of the row ``line`` refers to, in the file or not."""
        mapped = self.ids[kind].get(original)
        if mapped is not None:
            return mapped
        return original if self.ours(line) else derived_id(self.brain, original)

    def refuse(self, number: int, field: str, msg: str, kind: str) -> None:
        self.errors.append(LineError(number, (field,), msg, kind))

    async def build(self, session: AsyncSession) -> None:
        brain = self.brain
        # Ids other brains hold are never written to, whatever a line claims.
        for kind, model in _ROW_MODELS.items():
            rows = [row for _, row in of_kind(self.lines, Row) if row.kind == kind]
            taken = await _held_elsewhere(session, brain, model, model.id, [r.id for r in rows])
            for row in rows:
                keep = self.ours(row) and row.id not in taken
                self.ids[kind][row.id] = row.id if keep else derived_id(brain, row.id)
        episodes = [e for _, e in of_kind(self.lines, EpisodeLine) if e.trajectory_id is not None]
        wanted = [e.trajectory_id for e in episodes if e.trajectory_id is not None]
        taken = await _held_elsewhere(session, brain, Episode, Episode.trajectory_id, wanted)
        for episode in episodes:
            original = episode.trajectory_id
            assert original is not None
            keep = self.ours(episode) and original not in taken
            self.trajectories[original] = original if keep else derived_id(brain, original)
        await self._check_relation_ends(session)
        await self._check_facts(session)
        await self._check_successors(session)
        await self._check_entities(session)
        await self._check_relations(session)
        await self._check_episodes(session)

    async def _check_relation_ends(self, session: AsyncSession) -> None:
        """Each end not in the file must be an entity of the brain."""
        outside: dict[str, list[tuple[int, str, str]]] = {}
        for number, relation in of_kind(self.lines, RelationLine):
            for end, original in (
                ("source_id", relation.source_id),
                ("target_id", relation.target_id),
            ):
                if original not in self.ids["entity"]:
                    entity_id = self.reference("entity", original, relation)
                    outside.setdefault(entity_id, []).append((number, end, original))
        if not outside:
            return
        found = set(
            (
                await session.execute(
                    select(Entity.id).where(
                        _any(Entity.id, outside),
                        Entity.tenant_id == self.brain.tenant_id,
                        Entity.user_id == self.brain.user_id,
                    )
                )
            ).scalars()
        )
        for entity_id, uses in outside.items():
            if entity_id not in found:
                for number, end, original in uses:
                    msg = f"no entity {original!r} in the file or the brain"
                    self.refuse(number, end, msg, "unknown_entity")

    async def _check_facts(self, session: AsyncSession) -> None:
        """One current fact per text and per key."""
        current = [(n, f) for n, f in of_kind(self.lines, FactLine) if f.valid_to is None]
        norms = {normalize(fact.text): number for number, fact in current}
        keys = {key: number for number, fact in current if (key := fact_key(fact.key))}
        if not current:
            return
        in_file = set(self.ids["fact"].values())
        rows = await session.execute(
            select(Fact.id, Fact.norm, Fact.key).where(
                Fact.tenant_id == self.brain.tenant_id,
                Fact.user_id == self.brain.user_id,
                Fact.valid_to.is_(None),
                or_(_any(Fact.norm, norms), _any(Fact.key, keys)),
            )
        )
        for fact_id, norm, key in rows:
            if fact_id in in_file:
                continue  # the file says what becomes of it
            if norm in norms:
                msg = f"the brain holds this fact as {fact_id!r}: import it under that id"
                self.refuse(norms[norm], "text", msg, "conflict")
            elif key in keys:
                msg = f"the brain's current fact {fact_id!r} has this key, and only one may"
                self.refuse(keys[key], "key", msg, "conflict")

    async def _check_successors(self, session: AsyncSession) -> None:
        """One fact superseded by each fact."""
        successors = {
            self.reference("fact", fact.superseded_by, fact): number
            for number, fact in of_kind(self.lines, FactLine)
            if fact.superseded_by is not None
        }
        if not successors:
            return
        in_file = set(self.ids["fact"].values())
        rows = await session.execute(
            select(Fact.id, Fact.superseded_by).where(
                Fact.tenant_id == self.brain.tenant_id,
                Fact.user_id == self.brain.user_id,
                _any(Fact.superseded_by, successors),
            )
        )
        for fact_id, successor in rows:
            if fact_id not in in_file and successor is not None:
                msg = f"the brain's fact {fact_id!r} is the one superseded by this fact"
                self.refuse(successors[successor], "superseded_by", msg, "conflict")

    async def _check_entities(self, session: AsyncSession) -> None:
        """One entity per kind and name."""
        names: dict[tuple[str, str], int] = {
            (entity.entity_kind, entity_norm(entity.name)): number
            for number, entity in of_kind(self.lines, EntityLine)
        }
        if not names:
            return
        in_file = set(self.ids["entity"].values())
        rows = await session.execute(
            select(Entity.id, Entity.kind, Entity.norm).where(
                Entity.tenant_id == self.brain.tenant_id,
                Entity.user_id == self.brain.user_id,
                _any(Entity.norm, {norm for _, norm in names}),
            )
        )
        for entity_id, kind, norm in rows:
            if entity_id not in in_file and (kind, norm) in names:
                msg = f"the brain holds this entity as {entity_id!r}"
                self.refuse(names[(kind, norm)], "name", msg, "conflict")

    async def _check_relations(self, session: AsyncSession) -> None:
        """One relation per source, relation and target."""
        edges: dict[tuple[str, str, str], int] = {}
        for number, relation in of_kind(self.lines, RelationLine):
            edge = (
                self.reference("entity", relation.source_id, relation),
                relation.relation,
                self.reference("entity", relation.target_id, relation),
            )
            # Lines naming one entity by its id here and by its id there.
            if edge in edges:
                msg = f"the same relation as line {edges[edge]}"
                self.refuse(number, "relation", msg, "duplicate")
            edges.setdefault(edge, number)
        if not edges:
            return
        in_file = set(self.ids["relation"].values())
        rows = await session.execute(
            select(Relation.id, Relation.source_id, Relation.relation, Relation.target_id).where(
                _any(Relation.source_id, {source for source, _, _ in edges})
            )
        )
        for relation_id, source, name, target in rows:
            if relation_id not in in_file and (source, name, target) in edges:
                msg = f"the brain holds this relation as {relation_id!r}"
                self.refuse(edges[(source, name, target)], "relation", msg, "conflict")

    async def _check_episodes(self, session: AsyncSession) -> None:
        """One episode per trajectory."""
        by_trajectory = {
            self.trajectories[episode.trajectory_id]: number
            for number, episode in of_kind(self.lines, EpisodeLine)
            if episode.trajectory_id is not None
        }
        if not by_trajectory:
            return
        in_file = set(self.ids["episode"].values())
        rows = await session.execute(
            select(Episode.id, Episode.trajectory_id).where(
                _any(Episode.trajectory_id, by_trajectory)
            )
        )
        for episode_id, trajectory_id in rows:
            if episode_id not in in_file and trajectory_id is not None:
                msg = "another episode of the brain was learned from this trajectory"
                self.refuse(by_trajectory[trajectory_id], "trajectory_id", msg, "conflict")


def _any(column: Any, values: Iterable[str]) -> Any:
    """``column = ANY(:values)``: one parameter however many values. (``IN``
    takes one per value, and PostgreSQL at most 32,767 in a statement.)"""
    return column == any_(literal(sorted(set(values)), ARRAY(Text)))


async def _held_elsewhere(
    session: AsyncSession, brain: Brain, model: _RowModel, column: Any, values: Sequence[str]
) -> set[str]:
    """Which of ``values`` (of ``column``) rows of other brains hold."""
    if not values:
        return set()
    rows = await session.execute(
        select(column).where(
            _any(column, values),
            not_(and_(model.tenant_id == brain.tenant_id, model.user_id == brain.user_id)),
        )
    )
    return set(rows.scalars())


async def import_lines(
    session: AsyncSession, brain: Brain, lines: Sequence[Numbered]
) -> ImportResult:
    """Write ``lines`` (from :func:`parse`) into ``brain``; the caller owns the transaction.

    Raises :class:`ImportRefused`, having written nothing, when a line
    cannot go in: it collides with a row of the brain, or relates an entity
    that is nowhere.
    """
    await lock_brain(session, brain)
    plan = _Plan(brain, lines)
    await plan.build(session)
    if plan.errors:
        raise ImportRefused(plan.errors)
    mine = {"tenant_id": brain.tenant_id, "user_id": brain.user_id}
    facts = [
        {
            "id": plan.ids["fact"][fact.id],
            **mine,
            "text": fact.text,
            "norm": normalize(fact.text),
            "key": fact_key(fact.key),
            "confidence": fact.confidence,
            "sources": fact.sources,
            "valid_from": fact.valid_from,
            "valid_to": fact.valid_to,
            "superseded_by": fact.superseded_by
            and plan.reference("fact", fact.superseded_by, fact),
            "created_at": fact.created_at,
            "updated_at": fact.updated_at,
        }
        for _, fact in of_kind(lines, FactLine)
    ]
    episodes = [
        {
            "id": plan.ids["episode"][episode.id],
            **mine,
            "task_id": episode.task_id,
            "trajectory_id": episode.trajectory_id and plan.trajectories[episode.trajectory_id],
            "text": episode.text,
            "outcome": episode.outcome,
            "participants": episode.participants,
            "occurred_at": episode.occurred_at,
            "created_at": episode.created_at,
        }
        for _, episode in of_kind(lines, EpisodeLine)
    ]
    entities = [
        {
            "id": plan.ids["entity"][entity.id],
            **mine,
            "name": entity.name,
            "norm": entity_norm(entity.name),
            "kind": entity.entity_kind,
            "description": entity.description,
            "evidence": entity.evidence,
            "created_at": entity.created_at,
            "updated_at": entity.updated_at,
        }
        for _, entity in of_kind(lines, EntityLine)
    ]
    relations = [
        {
            "id": plan.ids["relation"][relation.id],
            **mine,
            "source_id": plan.reference("entity", relation.source_id, relation),
            "relation": relation.relation,
            "target_id": plan.reference("entity", relation.target_id, relation),
            "evidence": relation.evidence,
            "created_at": relation.created_at,
        }
        for _, relation in of_kind(lines, RelationLine)
    ]
    souls = [
        {
            **mine,
            "version": soul.version,
            "content": soul.content,
            "source": soul.source,
            "trajectory_id": soul.trajectory_id,
            "created_at": soul.created_at,
        }
        for _, soul in of_kind(lines, SoulLine)
    ]
    result = ImportResult(lines=len(lines))
    # Closed facts first: a current fact the file closes leaves the "one
    # current fact per text" index before the fact replacing it enters.
    await _upsert(session, brain, "fact", Fact, [f for f in facts if f["valid_to"]], result)
    await _upsert(session, brain, "fact", Fact, [f for f in facts if not f["valid_to"]], result)
    await _upsert(session, brain, "episode", Episode, episodes, result)
    # Entities before the relations that join them (a foreign key).
    await _upsert(session, brain, "entity", Entity, entities, result)
    await _upsert(session, brain, "relation", Relation, relations, result)
    await _upsert(session, brain, "soul", SoulVersion, souls, result)
    return result


async def _upsert(
    session: AsyncSession,
    brain: Brain,
    kind: str,
    model: _RowModel | type[SoulVersion],
    rows: list[dict[str, Any]],
    result: ImportResult,
) -> None:
    """Insert ``rows``, or update the brain's rows of their keys; rows already so stay untouched."""
    if not rows:
        return
    table = model.__table__
    keys = ["tenant_id", "user_id", "version"] if model is SoulVersion else ["id"]
    columns = [name for name in rows[0] if name not in keys]
    # One statement whatever the number of rows: each column travels as one
    # array and unnest() turns them back into rows (a multi-row VALUES would
    # take a parameter per value and cost the driver seconds to parse).
    names = keys + columns
    statement = insert(model).from_select(
        names, select(*(_unnest(table.c[name], rows) for name in names))
    )
    excluded = statement.excluded
    upsert = statement.on_conflict_do_update(
        index_elements=keys,
        set_={name: excluded[name] for name in columns},
        where=and_(
            # Never another brain's row, whatever its id.
            table.c.tenant_id == brain.tenant_id,
            table.c.user_id == brain.user_id,
            # A row already as the line says is left alone: the second
            # import of a file writes nothing and reports it so.
            tuple_(*(table.c[name] for name in columns)).is_distinct_from(
                tuple_(*(excluded[name] for name in columns))
            ),
        ),
    ).returning(table.c[keys[-1]], literal_column("xmax = 0"))
    written = (await session.execute(upsert)).all()
    created = sum(1 for _, inserted in written if inserted)
    result.created[kind] += created
    result.updated[kind] += len(written) - created
    result.unchanged[kind] += len(rows) - len(written)
    if kind in result.written:
        result.written[kind].extend(str(key) for key, _ in written)


def _unnest(column: Any, rows: Sequence[dict[str, Any]]) -> Any:
    """``unnest(:values)`` of ``column``'s values in ``rows``, typed as the column."""
    values = [row[column.name] for row in rows]
    array: Any
    if isinstance(column.type, JSONB):
        # No driver adapts a list of JSON documents to jsonb[]: text[], cast.
        texts = [json.dumps(value) for value in values]
        array = cast(literal(texts, ARRAY(Text)), ARRAY(JSONB))
    else:
        array = literal(values, ARRAY(column.type))
    return func.unnest(array).label(column.name)
