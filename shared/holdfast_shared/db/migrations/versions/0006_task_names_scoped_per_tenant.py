"""task names scoped per tenant

A task's ``id`` is now minted by the engine and never reused: every row,
Redis key and workspace of the task is keyed by it. What the client calls
the task (``task_id`` on the API) is ``name``, unique within its tenant only,
so two tenants may both have a task ``X`` without seeing each other, and a
name freed by a delete can be taken again without reaching the old task's
data. Existing tasks keep their id and get it as their name.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 13:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("tasks", sa.Column("name", sa.String(length=128), nullable=True))
    op.execute("UPDATE tasks SET name = id")
    op.alter_column("tasks", "name", nullable=False)
    op.create_unique_constraint("uq_tasks_tenant_id_name", "tasks", ["tenant_id", "name"])


def downgrade() -> None:
    op.drop_constraint("uq_tasks_tenant_id_name", "tasks", type_="unique")
    op.drop_column("tasks", "name")
