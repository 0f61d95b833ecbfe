"""Execute keys: a client's Idempotency-Key on POST /execute, one turn per key

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-27 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "execute_keys",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("turn_id", sa.String(length=64), nullable=False),
        sa.Column("after_seq", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_execute_keys_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["turn_id"],
            ["turns.id"],
            name=op.f("fk_execute_keys_turn_id_turns"),
            ondelete="CASCADE",
            deferrable=True,
            initially="DEFERRED",
        ),
        sa.PrimaryKeyConstraint("tenant_id", "key", name=op.f("pk_execute_keys")),
    )
    op.create_index(op.f("ix_execute_keys_turn_id"), "execute_keys", ["turn_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_execute_keys_turn_id"), table_name="execute_keys")
    op.drop_table("execute_keys")
