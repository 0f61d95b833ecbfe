"""Where the soul and retrieved memory come from: an interface, filled later.

The context has a section for the user's soul (core identity, learned
patterns and preferences) and one for memory retrieved by similarity to the
current message (episodes, knowledge, the social graph). The long-term
memory that fills them arrives with the learning centre; until then
:class:`NoMemory` answers both with nothing, and the sections are empty
rather than missing.
"""

from __future__ import annotations

from typing import Protocol


class MemorySource(Protocol):
    async def soul(self, tenant_id: str) -> str:
        """The user's soul document, rendered ("" when there is none)."""
        ...

    async def retrieve(self, tenant_id: str, task_id: str, query: str, limit: int) -> list[str]:
        """Up to ``limit`` memories relevant to ``query``, most relevant first."""
        ...


class NoMemory:
    """No long-term memory: an empty soul, nothing retrieved."""

    async def soul(self, tenant_id: str) -> str:
        return ""

    async def retrieve(self, tenant_id: str, task_id: str, query: str, limit: int) -> list[str]:
        return []
