"""Hibernate idle workspaces: archive them and release the local copy.

A task whose workspace saw no tool call here for
``HOLDFAST_WORKSPACE_HIBERNATE_AFTER_SECONDS`` is checkpointed (incrementally:
usually its turn end already archived it, so only a scan) and its workspace is
removed from this disk — unmounted, its image deleted. Its next tool call, on
this runner or any other, restores the head (``checkpoints.py``). A workspace in
use (a call holds its lock) is skipped and looked at again next sweep; one
that cannot be archived is kept.
"""

from __future__ import annotations

import asyncio
import logging

from holdfast_tool_runner.checkpoints import WorkspaceCheckpoints
from holdfast_tool_runner.sandbox import reap_leftovers

log = logging.getLogger(__name__)


def sweep_interval(after_seconds: float) -> float:
    """How often to look for idle workspaces: a fraction of the idle time, so a
    workspace is released not much later than it became idle enough."""
    return min(60.0, max(0.2, after_seconds / 4))


async def hibernate_idle(archiving: WorkspaceCheckpoints, after_seconds: float) -> list[str]:
    """Hibernate every workspace here idle for ``after_seconds``; their task ids."""
    if after_seconds <= 0:
        return []
    workspaces = archiving.workspaces
    hibernated = []
    for tenant_id, task_id in await asyncio.to_thread(workspaces.list):
        if not await asyncio.to_thread(workspaces.exists, tenant_id, task_id):
            continue  # an image nobody mounted since a restart: not in use here
        if await asyncio.to_thread(archiving.idle_seconds, tenant_id, task_id) < after_seconds:
            continue
        fd = await archiving.lock(tenant_id, task_id, exclusive=True, wait=False)
        if fd is None:
            continue  # a call (or a checkpoint) is using it
        try:
            if await asyncio.to_thread(archiving.idle_seconds, tenant_id, task_id) < after_seconds:
                continue  # used while we waited for the lock
            await reap_leftovers(workspaces.path(tenant_id, task_id))
            archive_id = await archiving.checkpoint_locked(tenant_id, task_id, "hibernate")
            if archive_id is None:
                continue
            await asyncio.to_thread(workspaces.remove, tenant_id, task_id)
            await asyncio.to_thread(archiving.drop_state, tenant_id, task_id)
            hibernated.append(task_id)
            log.info("task %s hibernated: its workspace is archive %s", task_id, archive_id)
        except Exception:
            log.warning("could not hibernate the workspace of task %s", task_id, exc_info=True)
        finally:
            archiving.release(fd)
    return hibernated
