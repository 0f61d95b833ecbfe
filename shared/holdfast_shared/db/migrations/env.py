"""Alembic environment: runs migrations over the async psycopg engine."""

from __future__ import annotations

import asyncio

from alembic import context
from alembic.runtime.environment import NameFilterParentNames, NameFilterType
from holdfast_shared.db.models import Base
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

config = context.config
target_metadata = Base.metadata

# Tables kept outside the models on purpose, which autogenerate must neither
# drop nor report: memory_vectors exists only where PostgreSQL has pgvector
# (holdfast_shared/memory/vectors.py makes it after the migrations).
UNMANAGED_TABLES = frozenset({"memory_vectors"})


def include_name(
    name: str | None, type_: NameFilterType, parent_names: NameFilterParentNames
) -> bool:
    return not (type_ == "table" and name in UNMANAGED_TABLES)


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection, target_metadata=target_metadata, include_name=include_name
    )
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    url = config.get_main_option("sqlalchemy.url")
    assert url is not None
    engine = create_async_engine(url)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        include_name=include_name,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
