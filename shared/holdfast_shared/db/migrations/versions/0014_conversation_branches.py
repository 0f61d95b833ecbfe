"""conversation branches: edited and retried messages fork the conversation

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-23 19:58:00.000000
"""

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
