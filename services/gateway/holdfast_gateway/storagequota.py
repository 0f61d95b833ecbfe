"""``HOLDFAST_TENANT_MAX_STORAGE_BYTES``: refuse new writes of a tenant over it.

Checked before a request writes anything — a new turn (``POST /execute``, a
message queued with ``on_busy``), a new execution, a memory import, a skill
upload — and answered 507 ``STORAGE_QUOTA_EXCEEDED`` with ``details.limit_bytes``
and ``details.used_bytes``. A turn already accepted is never cut short: what
it writes while it runs is counted against the next request. How usage is
measured, and how stale it may be: ``holdfast_gateway.storageusage``.
"""

from __future__ import annotations

from holdfast_shared.errors import ErrorCode
from holdfast_shared.workspace_checkpoints import store_from_settings

from holdfast_gateway.errors import ApiError
from holdfast_gateway.state import GatewayState
from holdfast_gateway.storageusage import StorageMeter


def meter(state: GatewayState) -> StorageMeter:
    """The meter of this gateway's Redis, database and archive store."""
    settings = state.settings
    return StorageMeter(
        state.redis,
        state.keys,
        state.sessions,
        store_from_settings(settings.workspace_store, state.sessions),
        refresh_seconds=settings.storage_usage_refresh_seconds,
    )


async def check_storage(state: GatewayState, tenant_id: str) -> None:
    """507 when the tenant stores its limit or more; nothing when there is no limit."""
    limit = state.settings.tenant_max_storage_bytes
    if limit <= 0:
        return
    used = (await meter(state).usage(tenant_id)).total
    if used >= limit:
        raise ApiError(
            507,
            ErrorCode.STORAGE_QUOTA_EXCEEDED,
            f"the tenant stores {used} bytes, at or over its limit of {limit} "
            "(HOLDFAST_TENANT_MAX_STORAGE_BYTES); delete tasks, executions or memories "
            "to free space",
            {"limit_bytes": limit, "used_bytes": used},
        )
