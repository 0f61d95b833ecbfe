"""Long-term memory in the loop: the soul, retrieved memories, the memory tools.

The context has a section for the brain's soul (core identity, learned
patterns and preferences) and one for memories retrieved by similarity to
the message that opened the turn (the best facts, episodes and social-graph
entries, interleaved, within ``HOLDFAST_MEMORY_CONTEXT_TOKENS``). Both are
read once per turn: the turn's later model calls reuse them, which keeps the
context's prefix stable for prompt caching and costs one search per turn.

The agent also searches and adds to its memory itself (``memory_search``,
``memory_save``); what it saves is a fact like any the learning centre
extracts, merged or superseding by the same rules.

:class:`NoMemory` is the engine without long-term memory (tests of the
context alone).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from holdfast_shared.jobs import ToolOutcome
from holdfast_shared.memory import Brain
from holdfast_shared.memory.index import MemoryIndex
from holdfast_shared.memory.search import KINDS, Hit, Kind, Searcher
from holdfast_shared.memory.store import MAX_FACT_CHARS, current_soul, save_fact
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.context import tokens

# Turns whose soul and memories are kept (the turns a worker runs at once, and then some).
_CACHED_TURNS = 512
# Results a memory_search call returns.
_SEARCH_RESULTS = 8


class MemorySource(Protocol):
    async def soul(self, brain: Brain, turn_id: str) -> str:
        """The brain's soul document ("" when there is none)."""
        ...

    async def retrieve(self, brain: Brain, turn_id: str, query: str) -> list[str]:
        """Memories relevant to ``query``, most relevant first, rendered one per line."""
        ...

    async def search_call(self, brain: Brain, tool_input: Mapping[str, Any]) -> ToolOutcome:
        """One ``memory_search`` tool call."""
        ...

    async def save_call(
        self, brain: Brain, task_id: str, tool_input: Mapping[str, Any]
    ) -> ToolOutcome:
        """One ``memory_save`` tool call."""
        ...


class NoMemory:
    """No long-term memory: an empty soul, nothing retrieved."""

    async def soul(self, brain: Brain, turn_id: str) -> str:
        return ""

    async def retrieve(self, brain: Brain, turn_id: str, query: str) -> list[str]:
        return []

    async def search_call(self, brain: Brain, tool_input: Mapping[str, Any]) -> ToolOutcome:
        return ToolOutcome(error="long-term memory is not available on this engine")

    async def save_call(
        self, brain: Brain, task_id: str, tool_input: Mapping[str, Any]
    ) -> ToolOutcome:
        return ToolOutcome(error="long-term memory is not available on this engine")


@dataclass(frozen=True, slots=True)
class _Read:
    soul: str
    query: str
    retrieved: list[str]


def render_hit(hit: Hit) -> str:
    if hit.kind == "episodes":
        when = hit.extra.get("occurred_at", "")[:10]
        return f"[episode {when}] {hit.text}"
    if hit.kind == "social":
        return f"[{hit.extra.get('entity_kind', 'entity')}] {hit.text}"
    return f"[fact] {hit.text}"


class BrainMemory:
    """The brain in PostgreSQL, read through :class:`Searcher`."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        searcher: Searcher,
        *,
        budget_tokens: int,
        per_kind: int = 6,
        index: MemoryIndex | None = None,
        reads: async_sessionmaker[AsyncSession] | None = None,
    ) -> None:
        self.sessions = sessions
        # Look-ups: autocommit sessions (holdfast_shared.db.autocommit_session_factory).
        self.reads = reads or sessions
        self.searcher = searcher
        self.index = index
        self.budget_tokens = budget_tokens
        self.per_kind = per_kind
        self._turns: OrderedDict[str, _Read] = OrderedDict()

    async def soul(self, brain: Brain, turn_id: str) -> str:
        return (await self._read(brain, turn_id, None)).soul

    async def retrieve(self, brain: Brain, turn_id: str, query: str) -> list[str]:
        return (await self._read(brain, turn_id, query)).retrieved

    async def _read(self, brain: Brain, turn_id: str, query: str | None) -> _Read:
        cached = self._turns.get(turn_id)
        if cached is not None and (query is None or cached.query == query):
            self._turns.move_to_end(turn_id)
            return cached
        async with self.reads() as session:
            soul = await current_soul(session, brain)
            hits = (
                await self.searcher.search(
                    session, brain, query, kinds=KINDS, limit=self.per_kind * len(KINDS)
                )
                if query
                else []
            )
        read = _Read(soul.content if soul else "", query or "", self._within_budget(hits))
        if query is not None:
            self._turns[turn_id] = read
            while len(self._turns) > _CACHED_TURNS:
                self._turns.popitem(last=False)
        return read

    def _within_budget(self, hits: list[Hit]) -> list[str]:
        lines: list[str] = []
        used = 0
        for hit in hits:
            line = render_hit(hit)
            cost = tokens.text_tokens(line) + 2
            if used + cost > self.budget_tokens:
                continue  # a shorter one further down may still fit
            lines.append(line)
            used += cost
        return lines

    # -- the memory tools ----------------------------------------------------------
    async def search_call(self, brain: Brain, tool_input: Mapping[str, Any]) -> ToolOutcome:
        query = tool_input.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolOutcome(error="memory_search needs a non-empty 'query' string")
        kind = tool_input.get("kind")
        if kind is not None and kind not in KINDS:
            return ToolOutcome(error=f"'kind' must be one of {', '.join(KINDS)}")
        kinds: tuple[Kind, ...] = (kind,) if kind is not None else KINDS
        async with self.sessions() as session:
            hits = await self.searcher.search(
                session, brain, query, kinds=kinds, limit=_SEARCH_RESULTS
            )
        return ToolOutcome(
            output={
                "results": [
                    {"kind": h.kind, "text": h.text, "id": h.id, "score": round(h.score, 4)}
                    for h in hits
                ]
            }
        )

    async def save_call(
        self, brain: Brain, task_id: str, tool_input: Mapping[str, Any]
    ) -> ToolOutcome:
        fact = tool_input.get("fact")
        if not isinstance(fact, str) or not fact.strip():
            return ToolOutcome(error="memory_save needs a non-empty 'fact' string")
        if len(fact) > MAX_FACT_CHARS:
            return ToolOutcome(error=f"a fact is at most {MAX_FACT_CHARS} characters")
        async with self.sessions.begin() as session:
            change = await save_fact(session, brain, fact, source=f"agent:{task_id}")
            if self.index is not None and change.action != "merged":
                await self.index.add(
                    session, brain, "knowledge", [(change.fact.id, change.fact.text)]
                )
        return ToolOutcome(output={"saved": change.fact.id, "action": change.action})
