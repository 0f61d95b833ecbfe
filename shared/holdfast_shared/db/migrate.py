"""Run Alembic migrations from code: ``upgrade_head`` before services start."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from holdfast_shared.db.engine import to_async_url

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    # Percent signs would be read as interpolation by configparser.
    config.set_main_option("sqlalchemy.url", to_async_url(database_url).replace("%", "%%"))
    return config


def upgrade_head(database_url: str) -> None:
    """Bring the schema to the newest migration (idempotent; blocking)."""
    command.upgrade(alembic_config(database_url), "head")
    # Then what no migration can hold: memory_vectors needs pgvector, which a
    # plain PostgreSQL may lack. It is made where the server has it, and
    # reported (never raised) where it has not.
    from holdfast_shared.memory.vectors import install_blocking

    install_blocking(database_url)
