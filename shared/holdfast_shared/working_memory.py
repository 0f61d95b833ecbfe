"""Reading a task's working memory: the live Redis copy, else what its last turn left.

The loop-worker keeps and changes it (``context/working_memory.py``); the
gateway reads it for ``GET /tasks/{task_id}/working-memory``. Both read it
here, so they agree on where it lives and how it decodes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Any, cast

from redis.asyncio import Redis

from holdfast_shared.keys import Keys


async def live_working_memory(redis: Redis, keys: Keys, task_id: str) -> dict[str, str] | None:
    """The Redis copy; None when there is none (never written, or expired)."""
    # redis-py types hash commands as sync-or-async; on this client they are async.
    found = await cast("Awaitable[dict[Any, Any]]", redis.hgetall(keys.working_memory(task_id)))
    return {str(k): str(v) for k, v in found.items()} if found else None


def stored_working_memory(stored: Mapping[str, Any] | None) -> dict[str, str]:
    """The copy kept with the task (``tasks.working_memory``), as notes."""
    return {str(k): str(v) for k, v in (stored or {}).items()}
