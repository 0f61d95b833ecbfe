"""Writing events to PostgreSQL's ``events`` table in one statement, with what must
commit with them (a turn's rows at an iteration boundary)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, Text, bindparam, cast, column, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession
from sqlalchemy.sql.dml import UpdateBase

from holdfast_shared.db.models import EventRecord


@dataclass(frozen=True, slots=True)
class Writes:
    """Statements to commit with a task's last unarchived events, sent with them as ONE
    SQL statement: each but the last becomes a data-modifying CTE of the last
    (``WITH w0 AS (INSERT ... events), w1 AS (INSERT ... message) INSERT ... snapshot``).
    A statement is atomic on its own, so it needs no transaction either: one round
    trip to PostgreSQL where a transaction of several statements takes one per
    statement plus BEGIN and COMMIT — what a turn pays at every iteration boundary.

    The statements must not touch the same row twice (PostgreSQL's rule for one
    statement), and see the database as it was before any of them.
    """

    statements: tuple[UpdateBase, ...]


Also = Callable[[AsyncSession], Awaitable[None]] | Writes


_EVENT_COLUMNS = ("task_id", "seq", "turn_id", "type", "timestamp", "data")


def events_insert(rows: Sequence[dict[str, Any]]) -> UpdateBase:
    """``INSERT INTO events SELECT * FROM json_to_recordset(<the rows>)``, idempotent.

    The same SQL text for any number of rows, with one parameter: SQLAlchemy
    compiles it once and psycopg can prepare it, where a multi-row VALUES is a
    new statement (and a new cache entry) for every batch size. The rows travel
    as one JSON text, which ``json.dumps`` writes in C: as one array per column
    they went through psycopg's array dumper, element by element in Python, a
    third of a streaming worker's archiving time.
    """
    table = EventRecord.__table__
    records = (
        func.json_to_recordset(
            cast(bindparam("hf_events", json.dumps(list(rows), ensure_ascii=False), Text), JSON)
        )
        .table_valued(*(column(name, table.c[name].type) for name in _EVENT_COLUMNS))
        .render_derived("hf_events", with_types=True)
    )
    return (
        insert(EventRecord)
        .from_select(list(_EVENT_COLUMNS), select(*(records.c[name] for name in _EVENT_COLUMNS)))
        .on_conflict_do_nothing()
    )


def one_statement(statements: Sequence[UpdateBase]) -> UpdateBase:
    """``statements`` as one: each but the last a data-modifying CTE of the last."""
    *first, last = statements
    if not first:
        return last
    return last.add_cte(*(s.cte(f"hf_write_{i}") for i, s in enumerate(first)))


async def execute_at_once(engine: AsyncEngine, statement: UpdateBase) -> None:
    """One statement, atomic on its own: no BEGIN and COMMIT round trips."""
    async with engine.connect() as connection:
        await connection.execution_options(isolation_level="AUTOCOMMIT")
        await connection.execute(statement)
