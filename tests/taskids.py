"""The engine's own id of a task a test named (what its Redis keys and workspace use)."""

from __future__ import annotations

from holdfast_shared.tasks import find_task
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

# The tenants behind the ``api_keys`` fixture's keys.
TENANTS = {"main": "tenant-main", "other": "tenant-other"}


async def engine_task_id(
    sessions: async_sessionmaker[AsyncSession], name: str, tenant: str = "main"
) -> str:
    async with sessions() as session:
        task = await find_task(session, TENANTS[tenant], name)
    assert task is not None, f"no task {name!r} for tenant {tenant!r}"
    return task.id
