"""Tool effects: effect-class overrides, and numbered attempts of a tool call

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-26 20:50:00.000000
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # An agent's and a server entry's effect classes ({tool: read_only | idempotent |
    # effectful}), over the built-ins' and the MCP annotations'.
    for table in ("agents", "asset_servers"):
        op.add_column(
            table,
            sa.Column("effects", JSONB(), server_default=sa.text("'{}'::jsonb"), nullable=False),
        )
    # A call whose outcome was unknown and that runs again (same idempotency key)
    # is claimed again under the next attempt's number; each attempt runs once.
    op.add_column(
        "tool_results",
        sa.Column("attempt", sa.Integer(), server_default=sa.text("1"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("tool_results", "attempt")
    for table in ("asset_servers", "agents"):
        op.drop_column(table, "effects")
