"""Working memory: a per-task scratchpad the agent keeps through a tool.

The agent writes it with the ``working_memory`` tool (``set`` a key to a
value, ``delete`` a key); it is shown to the model in its own context
section on every call, and each change is announced as a
``working_memory_update`` event. Where it lives:

* in the turn's state, so every channel-state snapshot carries it and a
  turn taken over by another worker goes on with it;
* in Redis (``Keys.working_memory``), the live copy any process reads
  (``GET /tasks/{task_id}/working-memory``), expiring
  ``HOLDFAST_WORKING_MEMORY_TTL`` after its last change;
* in PostgreSQL (``tasks.working_memory``), written when each turn ends, so
  the next turn of the task finds it even after the Redis copy expired.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from holdfast_shared.keys import Keys
from holdfast_shared.working_memory import live_working_memory
from redis.asyncio import Redis

MAX_KEYS = 100
MAX_KEY_CHARS = 200
MAX_VALUE_CHARS = 10_000


@dataclass(frozen=True, slots=True)
class Change:
    """One accepted change: ``value`` None for a delete."""

    key: str
    value: str | None


def parse_change(tool_input: Mapping[str, Any], current: Mapping[str, str]) -> Change | str:
    """The change a ``working_memory`` call asks for, or why it is refused."""
    action, key, value = tool_input.get("action"), tool_input.get("key"), tool_input.get("value")
    if not isinstance(key, str) or not key.strip() or len(key) > MAX_KEY_CHARS:
        return f"'key' must be a non-empty string of at most {MAX_KEY_CHARS} characters"
    if "\x00" in key or (isinstance(value, str) and "\x00" in value):
        return "working memory cannot hold NUL characters"
    if action == "delete":
        return Change(key, None)
    if action != "set":
        return "'action' must be 'set' or 'delete'"
    if not isinstance(value, str) or len(value) > MAX_VALUE_CHARS:
        return f"'set' needs a string 'value' of at most {MAX_VALUE_CHARS} characters"
    if key not in current and len(current) >= MAX_KEYS:
        return f"working memory holds at most {MAX_KEYS} keys; delete one first"
    return Change(key, value)


def render(memory: Mapping[str, str]) -> str:
    """The working-memory section of the context ("" when empty)."""
    if not memory:
        return ""
    lines = [f"- {key}: {value}" for key, value in sorted(memory.items())]
    return "# Working memory (your notes for this task)\n" + "\n".join(lines)


class WorkingMemoryStore:
    """The Redis copy of each task's working memory."""

    def __init__(self, redis: Redis, keys: Keys, *, ttl_seconds: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_seconds = ttl_seconds

    async def load(self, task_id: str) -> dict[str, str] | None:
        """The live copy; None when there is none (never written, or expired)."""
        return await live_working_memory(self.redis, self.keys, task_id)

    async def apply(self, task_id: str, change: Change) -> None:
        key = self.keys.working_memory(task_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            if change.value is None:
                pipe.hdel(key, change.key)
            else:
                pipe.hset(key, change.key, change.value)
            pipe.expire(key, self.ttl_seconds)
            await pipe.execute()

    async def replace(self, task_id: str, memory: Mapping[str, str]) -> None:
        """Make the live copy exactly ``memory`` (a turn taken over, a task resumed)."""
        key = self.keys.working_memory(task_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            if memory:
                pipe.hset(key, mapping=dict(memory))
                pipe.expire(key, self.ttl_seconds)
            await pipe.execute()
