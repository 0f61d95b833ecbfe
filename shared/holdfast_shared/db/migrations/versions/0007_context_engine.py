"""context engine: summaries, working memory and token calibration per task

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 14:20:00
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "tasks",
        sa.Column("working_memory", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )
    op.add_column("tasks", sa.Column("token_calibration", sa.Float(), nullable=True))
    op.create_table(
        "context_summaries",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("task_id", sa.String(length=128), nullable=False),
        sa.Column("last_message_id", sa.BigInteger(), nullable=False),
        sa.Column("summary", sa.Text(), nullable=False),
        sa.Column("summarized_messages", sa.Integer(), nullable=False),
        sa.Column("summary_tokens", sa.Integer(), nullable=False),
        sa.Column("tokens_before", sa.Integer(), nullable=False),
        sa.Column("tokens_after", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["task_id"],
            ["tasks.id"],
            name=op.f("fk_context_summaries_task_id_tasks"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_context_summaries")),
        sa.UniqueConstraint(
            "task_id", "last_message_id", name=op.f("uq_context_summaries_task_id")
        ),
    )
    op.create_index(
        op.f("ix_context_summaries_task_id"), "context_summaries", ["task_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_context_summaries_task_id"), table_name="context_summaries")
    op.drop_table("context_summaries")
    op.drop_column("tasks", "token_calibration")
    op.drop_column("tasks", "working_memory")
