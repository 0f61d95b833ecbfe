"""Report how many bytes this runner's live workspaces take, per tenant.

Consumes: the workspaces on this runner's disk (``Workspaces.list``).
Produces: ``Keys.tenant_workspace_bytes(tenant)``, a Redis hash task id →
bytes, which the gateway adds to the tenant's stored bytes for
``HOLDFAST_TENANT_MAX_STORAGE_BYTES`` (``holdfast_gateway.storageusage``).

A workspace's bytes are the blocks its filesystem image really occupies (the
image is sparse: a 1 GiB cap costs what was written), or the blocks of its
files when workspaces are plain directories. Each report sets what is here and
takes out what this runner reported before and no longer holds (a hibernated
or deleted workspace). A runner that dies leaves its last figures until the
hash expires (a few reporting intervals without any runner reporting for the
tenant) or another runner takes the task over and reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import cast

from holdfast_shared.keys import Keys
from redis.asyncio import Redis

from holdfast_tool_runner.workspaces import Workspaces

# A tenant's hash outlives this many reporting intervals without a report.
_EXPIRE_INTERVALS = 4


def _allocated(path: Path) -> int:
    """Bytes the workspace occupies on the host: its image's blocks, else its files'."""
    image = path.with_name(f".{path.name}.img")
    with contextlib.suppress(FileNotFoundError):
        return os.stat(image).st_blocks * 512
    total = 0
    for directory, _subdirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
    return total


def measure(workspaces: Workspaces) -> dict[str, dict[str, int]]:
    """tenant → task → bytes of every workspace on this disk (blocking: run in a thread)."""
    found: dict[str, dict[str, int]] = {}
    for tenant_id, task_id in workspaces.list():
        found.setdefault(tenant_id, {})[task_id] = _allocated(workspaces.path(tenant_id, task_id))
    return found


class WorkspaceUsageReporter:
    """Call :meth:`report` every ``interval_seconds`` (main.py's background loop)."""

    def __init__(
        self, workspaces: Workspaces, redis: Redis, keys: Keys, *, interval_seconds: float
    ) -> None:
        self.workspaces = workspaces
        self.redis = redis
        self.keys = keys
        self.expire_ms = max(1000, int(interval_seconds * _EXPIRE_INTERVALS * 1000))
        self._reported: dict[str, set[str]] = {}

    async def report(self) -> None:
        sizes = await asyncio.to_thread(measure, self.workspaces)
        for tenant_id, gone in self._reported.items():
            stale = gone - set(sizes.get(tenant_id, {}))
            if stale:
                key = self.keys.tenant_workspace_bytes(tenant_id)
                await cast(Awaitable[int], self.redis.hdel(key, *stale))
        for tenant_id, tasks in sizes.items():
            key = self.keys.tenant_workspace_bytes(tenant_id)
            mapping = {task: str(size) for task, size in tasks.items()}
            await cast(Awaitable[int], self.redis.hset(key, mapping=mapping))
            await self.redis.pexpire(key, self.expire_ms)
        self._reported = {tenant: set(tasks) for tenant, tasks in sizes.items()}
