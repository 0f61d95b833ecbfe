"""Subagents: a child task knows its parent (and its depth); an agent names
the agents it may delegate to

Revision ID: 0021
Revises: 0020
Create Date: 2026-11-27 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("parent_task_id", sa.String(length=128), nullable=True))
    op.add_column(
        "tasks", sa.Column("depth", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.create_index(op.f("ix_tasks_parent_task_id"), "tasks", ["parent_task_id"])
    op.add_column(
        "agents",
        sa.Column(
            "subagents",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'[]'::jsonb"),
            nullable=False,
        ),
    )


def downgrade() -> None:
    op.drop_column("agents", "subagents")
    op.drop_index(op.f("ix_tasks_parent_task_id"), table_name="tasks")
    op.drop_column("tasks", "depth")
    op.drop_column("tasks", "parent_task_id")
