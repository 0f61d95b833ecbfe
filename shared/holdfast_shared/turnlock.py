"""The one-running-turn-per-task lock (``Keys.running_turn``)."""

from __future__ import annotations

from redis.asyncio import Redis

from holdfast_shared.keys import Keys

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class TurnLock:
    def __init__(self, redis: Redis, keys: Keys, *, ttl_seconds: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_seconds = ttl_seconds
        self._release = redis.register_script(_RELEASE)

    async def acquire(self, task_id: str, turn_id: str) -> bool:
        """Take the lock for ``turn_id``; False when another turn holds it."""
        ok = await self.redis.set(
            self.keys.running_turn(task_id), turn_id, nx=True, ex=self.ttl_seconds
        )
        return bool(ok)

    async def release(self, task_id: str, turn_id: str) -> bool:
        """Release only if ``turn_id`` still holds it (never another turn's lock)."""
        return bool(await self._release(keys=[self.keys.running_turn(task_id)], args=[turn_id]))

    async def holder(self, task_id: str) -> str | None:
        """The running turn's id, or None when the task is idle."""
        value = await self.redis.get(self.keys.running_turn(task_id))
        return str(value) if value is not None else None
