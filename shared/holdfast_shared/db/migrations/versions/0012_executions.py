"""executions and their checkpoints (the /v1/execution API)

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-23 19:58:00.000000
"""

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
