"""conversation branches: edited and retried messages fork the conversation

Also the turn's usage totals on its row, and the index that lists a tenant's
tasks by activity (GET /tasks).

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-23 19:58:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conversation_forks",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("task_id", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("after_message_id", sa.BigInteger(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["task_id"],
            ["tasks.id"],
            name=op.f("fk_conversation_forks_task_id_tasks"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conversation_forks")),
    )
    op.create_index(
        op.f("ix_conversation_forks_task_id"), "conversation_forks", ["task_id"], unique=False
    )
    op.add_column("messages", sa.Column("taken_off_by", sa.String(length=64), nullable=True))
    op.create_foreign_key(
        op.f("fk_messages_taken_off_by_conversation_forks"),
        "messages",
        "conversation_forks",
        ["taken_off_by"],
        ["id"],
    )
    op.create_index(
        "ix_messages_current",
        "messages",
        ["task_id", "id"],
        unique=False,
        postgresql_where=sa.text("taken_off_by IS NULL"),
    )
    op.add_column(
        "turns", sa.Column("usage", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )
    op.add_column("turns", sa.Column("active_ms", sa.BigInteger(), nullable=True))
    op.create_index(
        "ix_tasks_tenant_activity", "tasks", ["tenant_id", "updated_at", "id"], unique=False
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_tenant_activity", table_name="tasks")
    op.drop_column("turns", "active_ms")
    op.drop_column("turns", "usage")
    op.drop_index(
        "ix_messages_current",
        table_name="messages",
        postgresql_where=sa.text("taken_off_by IS NULL"),
    )
    op.drop_constraint(
        op.f("fk_messages_taken_off_by_conversation_forks"), "messages", type_="foreignkey"
    )
    op.drop_column("messages", "taken_off_by")
    op.drop_index(op.f("ix_conversation_forks_task_id"), table_name="conversation_forks")
    op.drop_table("conversation_forks")
