"""API keys: labels, last use and revocation

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-23 19:58:00.000000
"""

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
