"""API keys: labels, last use and revocation

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-23 19:58:00.000000
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The label (name) and revocation (revoked_at) columns exist since 0001;
    # what `holdfast keys list` adds is when each key was last used.
    op.add_column("api_keys", sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("api_keys", "last_used_at")
