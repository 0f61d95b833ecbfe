"""Completion webhooks: per-turn subscriptions, the tenant's signing secret, the outbox of deliveries

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-27 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

# The notification channel of due deliveries (holdfast_shared.webhooks.DUE_CHANNEL;
# a migration keeps its own copy: it must not change when the code does).
CHANNEL = "holdfast_webhooks_due"


def upgrade() -> None:
    # A turn's own subscription ({url, events}); None: the tenant's default.
    op.add_column("turns", sa.Column("webhook", JSONB(), nullable=True))
    op.create_table(
        "webhook_tenants",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        # Sealed by the Asset Directory's vault: signing needs it back in clear.
        sa.Column("secret", sa.Text(), nullable=True),
        sa.Column("previous_secret", sa.Text(), nullable=True),
        sa.Column("rotated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("default_webhook", JSONB(), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_webhook_tenants_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_webhook_tenants")),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("task_id", sa.String(length=128), nullable=False),
        sa.Column("turn_id", sa.String(length=64), nullable=False),
        sa.Column("event", sa.String(length=32), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("data", JSONB(), nullable=False),
        sa.Column("body", sa.Text(), nullable=True),
        sa.Column("status", sa.String(length=16), server_default="pending", nullable=False),
        sa.Column("attempts", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column(
            "next_attempt_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_webhook_deliveries_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(
        "ix_webhook_deliveries_due",
        "webhook_deliveries",
        ["status", "next_attempt_at"],
        unique=False,
    )
    op.create_index(
        "ix_webhook_deliveries_tenant",
        "webhook_deliveries",
        ["tenant_id", "status", "created_at"],
        unique=False,
    )
    # A delivery due now (a new one, a redelivered one) wakes the gateways that
    # LISTEN (webhooks/delivery.py) at its commit, instead of at their next poll.
    # Per row, so an insert that added nothing (ON CONFLICT, no subscription)
    # notifies nobody; PostgreSQL folds a transaction's identical notifications.
    op.execute(
        f"""
        CREATE FUNCTION holdfast_webhook_due() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', '');
            RETURN NULL;
        END $$
        """
    )
    op.execute(
        """
        CREATE TRIGGER webhook_deliveries_due
        AFTER INSERT OR UPDATE OF status ON webhook_deliveries
        FOR EACH ROW WHEN (NEW.status = 'pending' AND NEW.next_attempt_at <= now())
        EXECUTE FUNCTION holdfast_webhook_due()
        """
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS webhook_deliveries_due ON webhook_deliveries")
    op.execute("DROP FUNCTION IF EXISTS holdfast_webhook_due()")
    op.drop_index("ix_webhook_deliveries_tenant", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_tenants")
    op.drop_column("turns", "webhook")
