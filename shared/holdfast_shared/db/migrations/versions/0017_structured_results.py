"""Structured results: a turn's output schema and its validated result

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-27 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSON

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The JSON Schema the turn's answer must meet (``output_schema``), read by
    # whichever worker runs or resumes the turn; and the validated answer,
    # written with the turn's end. Both null for a turn that asked for none.
    # JSON, not JSONB: JSONB reorders an object's keys, and a schema's property
    # order is the order a model writes them in.
    op.add_column("turns", sa.Column("output_schema", JSON(), nullable=True))
    op.add_column("turns", sa.Column("result", JSON(), nullable=True))


def downgrade() -> None:
    op.drop_column("turns", "result")
    op.drop_column("turns", "output_schema")
