"""A brain as NDJSON: what ``GET /memory/export`` writes and ``POST /memory/import`` reads.

One JSON object per line, ``kind`` first: every ``fact`` (the superseded
history rows included), then every ``episode``, ``entity``, ``relation``
(after the entities they join) and ``soul`` version, each kind in the order
it was created (then by id), so the same brain always exports the same
bytes. A line holds every stored column, timestamps in ISO 8601 (UTC,
microseconds), except what is derived from the others and recomputed on
import: ``norm`` (the folded text or name) and the full-text ``tsv``. An
entity's own kind (person, organisation...) is its ``entity_kind``.

Not part of it: the trajectories the brain was learned from. They are raw
learning input, not memory, with a retention of their own
(``HOLDFAST_TRAJECTORY_RETENTION_DAYS``, then the archive); what was learned
from them is here.

:func:`parse` validates every line (:data:`LINE_ADAPTER`) and the lines
against each other — two lines for one row, or for rows that would collide,
are a ``duplicate`` — and reports each problem as a :class:`LineError`
naming the line (from 1) and the field. ``importing.py`` writes what it
returns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar, get_args

from holdfast_shared.content import Text
from holdfast_shared.db.models import Entity, Episode, Fact, Relation, SoulVersion
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.memory.brain import Brain
from holdfast_shared.memory.store import (
    ENTITY_KINDS,
    MAX_FACT_CHARS,
    MAX_SOUL_CHARS,
    normalize,
)
from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import PydanticCustomError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

MEDIA_TYPE = "application/x-ndjson"
# Kinds of line, in the order an export writes them.
LINE_KINDS = ("fact", "episode", "entity", "relation", "soul")
# A refused import names at most this many problems.
MAX_REPORTED_ERRORS = 20
MAX_SOUL_VERSION = 1_000_000_000

_Id = Annotated[str, Field(pattern=ID_PATTERN, max_length=64)]


def _in_utc(value: datetime) -> datetime:
    # PostgreSQL refuses offsets past ±15:59 that Python allows; in UTC every
    # instant is stored as it was given (or is a 422 when it has no year 1-9999).
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise PydanticCustomError(
            "datetime_out_of_range", "the instant is outside the years 1 to 9999 in UTC"
        ) from None


_When = Annotated[AwareDatetime, AfterValidator(_in_utc)]
EntityKind = Literal["person", "organisation", "project", "place", "other"]
assert get_args(EntityKind) == ENTITY_KINDS


class Line(BaseModel):
    # Strict: a timestamp is an ISO 8601 string, a number a JSON number —
    # as the schema says, not whatever could be coerced into one.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    # First in every line (subclasses narrow it to their Literal).
    kind: str
    # Where the line came from; the brain it goes to is the importer's.
    tenant_id: Annotated[Text, Field(max_length=64)] | None = None
    user_id: Annotated[Text, Field(max_length=128)] | None = None


class Row(Line):
    """A line of a row with an id of its own (every kind but the soul)."""

    id: _Id


class FactLine(Row):
    kind: Literal["fact"]
    text: Annotated[Text, Field(max_length=MAX_FACT_CHARS)]
    key: Annotated[Text, Field(max_length=200)] | None = None
    confidence: Annotated[float, Field(ge=0, le=1)]
    sources: list[Text] = []
    valid_from: _When
    valid_to: _When | None = None
    superseded_by: _Id | None = None
    created_at: _When
    updated_at: _When


class EpisodeLine(Row):
    kind: Literal["episode"]
    task_id: Annotated[Text, Field(max_length=128)] | None = None
    trajectory_id: Annotated[Text, Field(min_length=1, max_length=64)] | None = None
    text: Annotated[Text, Field(max_length=MAX_FACT_CHARS * 4)]
    outcome: Annotated[Text, Field(max_length=200)] | None = None
    participants: list[Text] = []
    occurred_at: _When
    created_at: _When


class EntityLine(Row):
    kind: Literal["entity"]
    name: Annotated[Text, Field(max_length=300)]
    # The entity's own kind (person, organisation...): ``kind`` is the line's.
    entity_kind: EntityKind
    description: Annotated[Text, Field(max_length=MAX_FACT_CHARS)] = ""
    evidence: list[Text] = []
    created_at: _When
    updated_at: _When


class RelationLine(Row):
    kind: Literal["relation"]
    source_id: _Id
    relation: Annotated[Text, Field(min_length=1, max_length=100)]
    target_id: _Id
    evidence: list[Text] = []
    created_at: _When


class SoulLine(Line):
    kind: Literal["soul"]
    # Far below the column's 2**31 - 1: revisions after an import add to it.
    version: Annotated[int, Field(ge=1, le=MAX_SOUL_VERSION)]
    content: Annotated[Text, Field(max_length=MAX_SOUL_CHARS)]
    source: Annotated[Text, Field(min_length=1, max_length=32)]
    trajectory_id: Annotated[Text, Field(max_length=64)] | None = None
    created_at: _When


AnyLine = FactLine | EpisodeLine | EntityLine | RelationLine | SoulLine
LINE_ADAPTER: TypeAdapter[AnyLine] = TypeAdapter(Annotated[AnyLine, Field(discriminator="kind")])
"""One line of the format: parse with ``validate_json``, write with ``dump_json``."""


# -- export ------------------------------------------------------------------------


def _line(line: type[Line], row: Any, **columns: str) -> Line:
    """``row`` as a ``line``: each field from the column of its name (or the one
    ``columns`` names), lists copied off the row."""
    values: dict[str, Any] = {}
    for name in line.model_fields:
        if name != "kind":
            value = getattr(row, columns.get(name, name))
            values[name] = list(value) if isinstance(value, list) else value
    (kind,) = get_args(line.model_fields["kind"].annotation)
    return line.model_construct(kind=kind, **values)


# (model, export order, its line, the columns of fields named otherwise)
_EXPORTED: tuple[tuple[Any, Any, type[Line], dict[str, str]], ...] = (
    (Fact, (Fact.created_at, Fact.id), FactLine, {}),
    (Episode, (Episode.created_at, Episode.id), EpisodeLine, {}),
    # The entity's own kind is its line's ``entity_kind`` (``kind`` is the line's).
    (Entity, (Entity.created_at, Entity.id), EntityLine, {"entity_kind": "kind"}),
    (Relation, (Relation.created_at, Relation.id), RelationLine, {}),
    (SoulVersion, (SoulVersion.version,), SoulLine, {}),
)


async def export(
    session: AsyncSession, brain: Brain, *, chunk_lines: int = 500
) -> AsyncIterator[bytes]:
    """The brain as NDJSON, up to ``chunk_lines`` lines per chunk, from one snapshot.

    Give it a session that has not begun a transaction: the export reads in
    one ``REPEATABLE READ`` transaction, so a learner writing meanwhile cannot
    split a fact from its history or a relation from its entities.
    """
    await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
    chunk: list[bytes] = []
    for model, order, line, columns in _EXPORTED:
        statement = (
            select(model)
            .where(model.tenant_id == brain.tenant_id, model.user_id == brain.user_id)
            .order_by(*order)
            .execution_options(yield_per=chunk_lines)
        )
        async for row in await session.stream_scalars(statement):
            chunk.append(_line(line, row, **columns).model_dump_json().encode() + b"\n")
            if len(chunk) >= chunk_lines:
                yield b"".join(chunk)
                chunk.clear()
    if chunk:
        yield b"".join(chunk)


# -- import: parsing ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LineError:
    """What is wrong with line ``line`` (from 1), at ``loc`` inside it."""

    line: int
    loc: tuple[str, ...]
    msg: str
    type: str

    def to_json(self) -> dict[str, Any]:
        return {
            "loc": ["body", f"line {self.line}", *self.loc],
            "line": self.line,
            "msg": self.msg,
            "type": self.type,
        }


class ImportRefused(Exception):
    """The lines cannot be imported as they are; nothing was written.

    ``errors`` are the first :data:`MAX_REPORTED_ERRORS` problems, in line
    order; ``total`` counts them all.
    """

    def __init__(self, errors: Sequence[LineError]) -> None:
        ordered = sorted(errors, key=lambda e: e.line)
        self.errors = ordered[:MAX_REPORTED_ERRORS]
        self.total = len(ordered)
        super().__init__("; ".join(f"line {e.line}: {e.msg}" for e in self.errors))


@dataclass(frozen=True, slots=True)
class Numbered:
    """A valid line and its number in the body (from 1)."""

    number: int
    line: AnyLine


L = TypeVar("L", bound=Line)


def of_kind(lines: Iterable[Numbered], kind: type[L]) -> list[tuple[int, L]]:
    return [(item.number, item.line) for item in lines if isinstance(item.line, kind)]


def parse(body: bytes) -> list[Numbered]:
    """Every non-blank line of ``body``, validated; else :class:`ImportRefused`.

    Besides each line on its own, refused: two lines for one row, or for rows
    that would collide (``duplicate``; see the module docstring).
    """
    errors: list[LineError] = []
    lines: list[Numbered] = []
    for number, raw in enumerate(body.split(b"\n"), start=1):
        if not raw.strip():
            continue  # blank lines (the last newline's among them) hold nothing
        try:
            line = LINE_ADAPTER.validate_json(raw)
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                loc = tuple(str(part) for part in err["loc"])
                # The union's level ("fact", "episode"...) repeats the line's kind.
                if loc and loc[0] in LINE_KINDS:
                    loc = loc[1:]
                errors.append(LineError(number, loc, err["msg"], err["type"]))
            continue
        lines.append(Numbered(number, line))
    if errors:
        raise ImportRefused(errors)
    duplicates = _duplicates(lines)
    if duplicates:
        raise ImportRefused(duplicates)
    return lines


def _duplicates(lines: Sequence[Numbered]) -> list[LineError]:
    """Lines naming a row an earlier line names, or one colliding with it."""
    errors: list[LineError] = []
    seen: dict[tuple[Any, ...], int] = {}

    def once(key: tuple[Any, ...], number: int, field: str, what: str) -> None:
        first = seen.setdefault(key, number)
        if first != number:
            errors.append(LineError(number, (field,), f"{what} as line {first}", "duplicate"))

    for number, row in of_kind(lines, Row):
        once((row.kind, row.id), number, "id", f"the same {row.kind} id")
    for number, soul in of_kind(lines, SoulLine):
        once(("soul", soul.version), number, "version", "the same soul version")
    for number, fact in of_kind(lines, FactLine):
        if fact.superseded_by is not None:
            # A fact supersedes one fact at most (fact_history follows the chain).
            successor = ("superseded_by", fact.superseded_by)
            once(successor, number, "superseded_by", "a fact superseded by the same fact")
            if fact.superseded_by == fact.id:
                msg = "a fact cannot supersede itself"
                errors.append(LineError(number, ("superseded_by",), msg, "conflict"))
        if fact.valid_to is None:
            once(("norm", normalize(fact.text)), number, "text", "the same current fact")
            if (key := fact_key(fact.key)) is not None:
                once(("key", key), number, "key", "a current fact of the same key")
    for number, episode in of_kind(lines, EpisodeLine):
        if episode.trajectory_id is not None:
            trajectory = ("trajectory", episode.trajectory_id)
            once(trajectory, number, "trajectory_id", "an episode of the same trajectory")
    for number, entity in of_kind(lines, EntityLine):
        name = ("name", entity.entity_kind, entity_norm(entity.name))
        once(name, number, "name", "an entity of the same kind and name")
    for number, relation in of_kind(lines, RelationLine):
        edge = ("edge", relation.source_id, relation.relation, relation.target_id)
        once(edge, number, "relation", "the same relation")
    return errors


def fact_key(key: str | None) -> str | None:
    # Folded as store.save_fact folds it.
    return (key or "").strip().casefold()[:200] or None


def entity_norm(name: str) -> str:
    return normalize(name)[:300]
