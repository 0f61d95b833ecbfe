"""The engine's own id of a task a test named (what its Redis keys and workspace use)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from holdfast_gateway.tasks import find_task
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

# The tenants behind the ``api_keys`` fixture's keys.
TENANTS = {"main": "tenant-main", "other": "tenant-other"}


async def engine_task_id(
    sessions: async_sessionmaker[AsyncSession],
    name: str,
    tenant: str = "main",
    *,
    wait: float = 0.0,
) -> str:
    """The engine's id of the tenant's task ``name`` (waiting up to ``wait``
    seconds for a task a request in flight is creating)."""
    for _ in range(max(1, int(wait / 0.05))):
        async with sessions() as session:
            task = await find_task(session, TENANTS[tenant], name)
        if task is not None:
            return task.id
        await asyncio.sleep(0.05)
    raise AssertionError(f"no task {name!r} for tenant {tenant!r}")


async def workspace_of(
    sessions: async_sessionmaker[AsyncSession],
    root: Path,
    name: str,
    tenant: str = "main",
    *,
    wait: float = 10.0,
) -> Path:
    """Where a tool-runner under ``root`` keeps the workspace of the tenant's
    task ``name`` (``<root>/<tenant>/<engine id>``), once the task exists."""
    for _ in range(int(wait / 0.05)):
        async with sessions() as session:
            task = await find_task(session, TENANTS[tenant], name)
        if task is not None:
            return root / TENANTS[tenant] / task.id
        await asyncio.sleep(0.05)
    raise AssertionError(f"no task {name!r} for tenant {tenant!r} after {wait} s")
