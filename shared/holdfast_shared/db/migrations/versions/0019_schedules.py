"""Schedules: cron, interval and one-shot schedules and one row per fired due time

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-27 00:00:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("cron", sa.String(length=200), nullable=True),
        sa.Column("interval_seconds", sa.Integer(), nullable=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("timezone", sa.String(length=64), nullable=False),
        sa.Column("anchor_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("task_id", sa.String(length=128), nullable=True),
        sa.Column("agent", sa.String(length=128), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("user_id", sa.String(length=128), server_default="", nullable=False),
        sa.Column("overlap", sa.String(length=16), nullable=False),
        sa.Column("catch_up", sa.String(length=16), nullable=False),
        sa.Column("output_schema", sa.JSON(), nullable=True),
        sa.Column("webhook", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("next_due_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_schedules_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedules")),
        sa.UniqueConstraint("tenant_id", "name", name="uq_schedules_tenant_id_name"),
    )
    op.create_index("ix_schedules_status_next_due", "schedules", ["status", "next_due_at"])
    op.create_table(
        "schedule_runs",
        sa.Column("id", sa.BigInteger(), autoincrement=True, nullable=False),
        sa.Column("schedule_id", sa.String(length=64), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("task_id", sa.String(length=128), nullable=True),
        sa.Column("turn_id", sa.String(length=64), nullable=True),
        sa.Column("fired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["schedule_id"],
            ["schedules.id"],
            name=op.f("fk_schedule_runs_schedule_id_schedules"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedule_runs")),
        # Inserting it is the claim: one row per due time, whichever gateway fires it.
        sa.UniqueConstraint("schedule_id", "due_at", name="uq_schedule_runs_schedule_id_due_at"),
    )
    op.create_index("ix_schedule_runs_status", "schedule_runs", ["status"])


def downgrade() -> None:
    op.drop_index("ix_schedule_runs_status", table_name="schedule_runs")
    op.drop_table("schedule_runs")
    op.drop_index("ix_schedules_status_next_due", table_name="schedules")
    op.drop_table("schedules")
