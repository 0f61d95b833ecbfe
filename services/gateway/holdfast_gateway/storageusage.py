"""How many bytes a tenant keeps stored, for ``HOLDFAST_TENANT_MAX_STORAGE_BYTES``.

Three parts, each measured where it really lives:

* the event log's archived rows in PostgreSQL (``octet_length`` of each
  event's JSON, over the tenant's tasks);
* the workspace archive store: blobs and manifests (PostgreSQL's
  ``workspace_blobs`` / ``workspace_archives``, or the files of a directory
  store — ``ArchiveStore.stored_bytes``);
* live workspaces on the tool-runners' disks: each runner reports the bytes its
  workspaces take (``holdfast_tool_runner.diskusage``) into a Redis hash per
  tenant (``Keys.tenant_workspace_bytes``), read as it is.

The first two are sums over many rows, too dear for every request: their total
is cached in Redis (``Keys.tenant_stored_bytes``) for ``refresh_seconds`` and
measured again by the first request after it expires, so every gateway shares
one figure. The figure may therefore be up to ``refresh_seconds`` old (plus a
tool-runner's reporting interval for workspaces, and the archiver's few
seconds for events still only in Redis): a quota is a bound a tenant may
overshoot by what it writes in that time, never a reason to cut a turn short.
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import cast

from holdfast_shared.db.models import EventRecord, Task
from holdfast_shared.keys import Keys
from holdfast_shared.workspace_checkpoints.stores import ArchiveStore
from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker


@dataclass(frozen=True, slots=True)
class StorageUsage:
    """A tenant's stored bytes: ``stored`` (PostgreSQL and the archive store,
    possibly cached) and ``workspaces`` (live, as the tool-runners reported)."""

    stored: int
    workspaces: int

    @property
    def total(self) -> int:
        return self.stored + self.workspaces


async def event_log_bytes(session: AsyncSession, tenant_id: str) -> int:
    """Bytes of the tenant's events archived in PostgreSQL."""
    found = await session.scalar(
        select(func.coalesce(func.sum(func.octet_length(EventRecord.data)), 0))
        .select_from(EventRecord)
        .join(Task, Task.id == EventRecord.task_id)
        .where(Task.tenant_id == tenant_id)
    )
    return int(found or 0)


class StorageMeter:
    """Measures tenants' usage; the cache and the reports live in Redis, so
    any number of gateways share them."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        sessions: async_sessionmaker[AsyncSession],
        store: ArchiveStore,
        *,
        refresh_seconds: float,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.sessions = sessions
        self.store = store
        self.refresh_seconds = refresh_seconds

    async def usage(self, tenant_id: str) -> StorageUsage:
        """The tenant's usage; the stored part is measured when its cache expired."""
        cached = await self.redis.get(self.keys.tenant_stored_bytes(tenant_id))
        if cached is None:
            stored = await self.measure_stored(tenant_id)
            await self.redis.set(
                self.keys.tenant_stored_bytes(tenant_id),
                stored,
                px=max(1, int(self.refresh_seconds * 1000)),
            )
        else:
            stored = int(cached)
        reported = await cast(
            Awaitable[list[str]], self.redis.hvals(self.keys.tenant_workspace_bytes(tenant_id))
        )
        return StorageUsage(stored, sum(int(v) for v in reported))

    async def measure_stored(self, tenant_id: str) -> int:
        """The stored part, measured now (no cache)."""
        async with self.sessions() as session:
            events = await event_log_bytes(session, tenant_id)
        return events + await self.store.stored_bytes(tenant_id)
