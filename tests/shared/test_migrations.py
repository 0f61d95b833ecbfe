"""The migrations build exactly the schema the models describe."""

from __future__ import annotations

from alembic import command
from holdfast_shared.db.migrate import alembic_config


def test_the_migrated_schema_matches_the_models(database_url: str) -> None:
    # Raises when autogenerate would find anything to add, drop or change.
    command.check(alembic_config(database_url))
