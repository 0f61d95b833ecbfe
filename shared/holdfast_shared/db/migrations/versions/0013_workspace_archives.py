"""workspace checkpoints: content-addressed file blobs and archive manifests

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-23 19:58:00.000000
"""

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
