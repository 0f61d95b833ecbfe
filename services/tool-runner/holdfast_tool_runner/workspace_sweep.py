"""Remove the workspaces of tasks that no longer exist.

A deleted task's workspace is removed by the runner that takes its
``WorkspaceRemoval`` job. Should that job be lost (Redis lost its data, the
stream was trimmed) the workspace would outlive its task; this sweep, at
start and then every ``interval`` seconds, removes every workspace on this
host whose task row is gone (the runner runs it with ``every``). It never
touches a live task's workspace: a task's row is committed before its first
tool call can create one.
"""

from __future__ import annotations

import asyncio
import logging

from holdfast_shared.db.models import Task
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_tool_runner.sandbox import reap_leftovers
from holdfast_tool_runner.workspaces import Workspaces

log = logging.getLogger(__name__)


async def sweep_once(
    workspaces: Workspaces, sessions: async_sessionmaker[AsyncSession]
) -> list[tuple[str, str]]:
    """Remove the workspaces whose task is gone; the (tenant, task) pairs removed."""
    on_disk = await asyncio.to_thread(workspaces.list)
    if not on_disk:
        return []
    async with sessions() as session:
        live = {
            (tenant, task)
            for tenant, task in await session.execute(
                select(Task.tenant_id, Task.id).where(Task.id.in_([t for _, t in on_disk]))
            )
        }
    removed = []
    for tenant, task in on_disk:
        if (tenant, task) in live:
            continue
        await reap_leftovers(workspaces.path(tenant, task))
        await asyncio.to_thread(workspaces.remove, tenant, task)
        removed.append((tenant, task))
    if removed:
        log.info("removed %d workspace(s) of deleted tasks", len(removed))
    return removed
