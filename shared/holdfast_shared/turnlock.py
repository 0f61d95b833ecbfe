"""The one-running-turn-per-task lock (``Keys.running_turn``)."""

from __future__ import annotations

from redis.asyncio import Redis

from holdfast_shared.keys import Keys

# Take the lock for this turn, or refresh it if the turn already holds it.
_ENSURE = """
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 1
end
return 0
"""

_REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
  return 1
end
return 0
"""

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
        self._ensure = redis.register_script(_ENSURE)
        self._replace = redis.register_script(_REPLACE)

    async def acquire(self, task_id: str, turn_id: str) -> bool:
        """Take the lock for ``turn_id``; False when another turn holds it."""
        ok = await self.redis.set(
            self.keys.running_turn(task_id), turn_id, nx=True, ex=self.ttl_seconds
        )
        return bool(ok)

    async def ensure(self, task_id: str, turn_id: str) -> bool:
        """Hold the lock for a turn being resumed (it may have expired, or Redis lost it)."""
        return await self.extend(task_id, turn_id, self.ttl_seconds)

    async def extend(self, task_id: str, turn_id: str, ttl_seconds: int) -> bool:
        """Keep the lock for ``ttl_seconds`` more; False if another turn holds it."""
        result = await self._ensure(
            keys=[self.keys.running_turn(task_id)], args=[turn_id, ttl_seconds]
        )
        return bool(result)

    async def replace(self, task_id: str, stale_turn: str, turn_id: str) -> bool:
        """Take the lock over from ``stale_turn`` (only if it still holds it)."""
        result = await self._replace(
            keys=[self.keys.running_turn(task_id)], args=[stale_turn, turn_id, self.ttl_seconds]
        )
        return bool(result)

    async def release(self, task_id: str, turn_id: str) -> bool:
        """Release only if ``turn_id`` still holds it (never another turn's lock)."""
        return bool(await self._release(keys=[self.keys.running_turn(task_id)], args=[turn_id]))

    async def holder(self, task_id: str) -> str | None:
        """The running turn's id, or None when the task is idle."""
        value = await self.redis.get(self.keys.running_turn(task_id))
        return str(value) if value is not None else None
