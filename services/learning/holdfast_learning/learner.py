"""Learning from trajectories: extraction, then one transaction per trajectory.

For each pending trajectory the learner asks the extractor (a model call,
outside any transaction), then writes everything the extraction holds — the
episode, facts (merged or superseding, store.py), entities and relations,
the revised soul — and marks the trajectory ``done`` in one transaction that
first locks the trajectory's row. So a trajectory is learned once: a second
learner (a redelivery, the sweep, a learner that took over a dead one's
batch) finds it ``done`` and writes nothing; a learner killed mid-write
leaves nothing, and the trajectory is learned again from scratch.

A failure (the model, its answer, the database) counts an attempt and sets
when to try again (exponential backoff); the sweep retries it then. After
``HOLDFAST_LEARNING_MAX_ATTEMPTS`` the trajectory is dead: its row says why
and its id is pushed on the dead-letter list.

Trajectories of different brains are learned concurrently; those of one
brain one after another, in the order they finished, so the soul and the
facts evolve in the order the user said things.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from holdfast_shared.db.models import SoulVersion, TrajectoryRecord
from holdfast_shared.keys import Keys
from holdfast_shared.memory import Brain
from holdfast_shared.memory.index import MemoryIndex, entity_text
from holdfast_shared.memory.store import (
    NewFact,
    add_episode,
    add_relation,
    revise_soul,
    save_facts,
    upsert_entity,
)
from holdfast_shared.observability import metrics
from redis.asyncio import Redis
from sqlalchemy import select, tuple_, update
from sqlalchemy.dialects.postgresql import distinct_on
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_learning.extract import Extractor
from holdfast_learning.extraction import Extraction

log = logging.getLogger(__name__)

# Brains learned at once (each holds a database connection while it writes).
_CONCURRENT_BRAINS = 8
# The dead-letter list keeps this many ids (the rows keep them all).
_DEAD_KEPT = 10_000
_BACKOFF_BASE_SECONDS = 5.0
_BACKOFF_MAX_SECONDS = 3600.0


def backoff(attempts: int) -> timedelta:
    return timedelta(seconds=min(_BACKOFF_MAX_SECONDS, _BACKOFF_BASE_SECONDS * 2 ** (attempts - 1)))


@dataclass
class BatchResult:
    learned: int = 0
    skipped: int = 0
    failed: int = 0
    dead: int = 0
    # Seconds spent waiting for the model, summed over the batch.
    model_seconds: float = 0.0
    ids: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _Pending:
    id: str
    brain: Brain
    task_id: str
    record: dict[str, object]
    started_at: datetime
    finished_at: datetime
    attempts: int


class Learner:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        redis: Redis,
        keys: Keys,
        extractor: Extractor,
        *,
        max_attempts: int,
        index: MemoryIndex | None = None,
    ) -> None:
        self.index = index
        self.sessions = sessions
        self.redis = redis
        self.keys = keys
        self.extractor = extractor
        self.max_attempts = max_attempts

    async def learn(self, trajectory_ids: Sequence[str], *, due_only: bool = True) -> BatchResult:
        """Learn the pending ones of ``trajectory_ids``; ``due_only``: skip those
        whose retry is not due yet (their announcement came early)."""
        result = BatchResult()
        pending = await self._pending(trajectory_ids, due_only=due_only)
        result.skipped = len(set(trajectory_ids)) - len(pending)
        by_brain: dict[Brain, list[_Pending]] = {}
        for item in pending:
            by_brain.setdefault(item.brain, []).append(item)
        gate = asyncio.Semaphore(_CONCURRENT_BRAINS)
        souls = await self._souls(list(by_brain))

        async def one_brain(items: list[_Pending]) -> None:
            async with gate:
                for item in items:
                    await self._learn_one(item, souls, result)

        async with asyncio.TaskGroup() as group:
            for items in by_brain.values():
                group.create_task(one_brain(items))
        return result

    async def _souls(self, brains: list[Brain]) -> dict[Brain, str]:
        """The current soul of each brain, in one query (the extractor revises it)."""
        if not brains:
            return {}
        latest = (
            select(SoulVersion.tenant_id, SoulVersion.user_id, SoulVersion.content)
            .where(
                tuple_(SoulVersion.tenant_id, SoulVersion.user_id).in_(
                    [(b.tenant_id, b.user_id) for b in brains]
                )
            )
            .order_by(SoulVersion.tenant_id, SoulVersion.user_id, SoulVersion.version.desc())
            .ext(distinct_on(SoulVersion.tenant_id, SoulVersion.user_id))
        )
        async with self.sessions() as session:
            rows = (await session.execute(latest)).all()
        return {Brain(tenant, user): content for tenant, user, content in rows}

    async def _pending(self, ids: Sequence[str], *, due_only: bool) -> list[_Pending]:
        now = datetime.now(UTC)
        query = select(TrajectoryRecord).where(
            TrajectoryRecord.id.in_(list(dict.fromkeys(ids))),
            TrajectoryRecord.status == "pending",
        )
        if due_only:
            query = query.where(
                (TrajectoryRecord.next_attempt_at.is_(None))
                | (TrajectoryRecord.next_attempt_at <= now)
            )
        async with self.sessions() as session:
            rows = (await session.execute(query.order_by(TrajectoryRecord.finished_at))).scalars()
            return [
                _Pending(
                    row.id,
                    Brain(row.tenant_id, row.user_id),
                    row.task_id,
                    row.record,
                    row.started_at,
                    row.finished_at,
                    row.attempts,
                )
                for row in rows
            ]

    async def _learn_one(
        self, item: _Pending, souls: dict[Brain, str], result: BatchResult
    ) -> None:
        try:
            extracted = await self.extractor.extract(item.record, souls.get(item.brain, ""))
            result.model_seconds += extracted.model_seconds
            async with self.sessions.begin() as session:
                # Marked done first: the row stays locked until the writes commit
                # with it, and a learner that got here first leaves nothing to do.
                claimed = await session.scalar(
                    update(TrajectoryRecord)
                    .where(TrajectoryRecord.id == item.id, TrajectoryRecord.status == "pending")
                    .values(status="done", processed_at=datetime.now(UTC), last_error=None)
                    .returning(TrajectoryRecord.id)
                )
                if claimed is None:
                    result.skipped += 1  # learned by someone else meanwhile, or forgotten
                    return
                await apply(session, item, extracted.extraction, self.index)
        except Exception as exc:
            await self._failed(item, exc, result)
            return
        if extracted.extraction.soul is not None and extracted.extraction.soul.strip():
            souls[item.brain] = extracted.extraction.soul.strip()
        result.learned += 1
        result.ids.append(item.id)
        metrics.trajectory_learned(item.finished_at)

    async def _failed(self, item: _Pending, exc: Exception, result: BatchResult) -> None:
        attempts = item.attempts + 1
        dead = attempts >= self.max_attempts
        error = f"{type(exc).__name__}: {exc}"[:2000]
        # The class only: an error's text can quote the trajectory (a provider
        # echoing the prompt, a validation error quoting the model's reply), and
        # trajectories hold commands, tool outputs and permission prompts. The
        # whole error stays with the row (last_error), in the database with the content.
        log.warning(
            "learning trajectory %s failed (attempt %d of %d): %s",
            item.id,
            attempts,
            self.max_attempts,
            type(exc).__name__,
        )
        async with self.sessions.begin() as session:
            await session.execute(
                update(TrajectoryRecord)
                .where(TrajectoryRecord.id == item.id, TrajectoryRecord.status == "pending")
                .values(
                    attempts=attempts,
                    last_error=error,
                    status="dead" if dead else "pending",
                    next_attempt_at=None if dead else datetime.now(UTC) + backoff(attempts),
                )
            )
        metrics.trajectory_failed(dead=dead)
        if dead:
            result.dead += 1
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.lpush(self.keys.learning_dead, item.id)
                pipe.ltrim(self.keys.learning_dead, 0, _DEAD_KEPT - 1)
                await pipe.execute()
        else:
            result.failed += 1


async def apply(
    session: AsyncSession,
    item: _Pending,
    extraction: Extraction,
    index: MemoryIndex | None = None,
) -> None:
    """Write one trajectory's extraction into its brain (inside the caller's transaction),
    with the vectors of what is new when there is an ``index``."""
    brain, source = item.brain, item.id
    episode = extraction.episode
    written = await add_episode(
        session,
        brain,
        summary=episode.summary,
        occurred_at=item.started_at,
        trajectory_id=item.id,
        task_id=item.task_id,
        outcome=episode.outcome,
        participants=episode.participants,
    )
    changes = await save_facts(
        session,
        brain,
        [NewFact(f.text, f.key, f.confidence) for f in extraction.facts],
        source=source,
        at=item.finished_at,
    )
    entities = {}
    for entity in extraction.entities:
        row = await upsert_entity(
            session,
            brain,
            entity.name,
            entity.kind,
            description=entity.description,
            evidence=source,
        )
        entities[entity.name.casefold()] = row
    for relation in extraction.relations:
        ends = []
        for name in (relation.source, relation.target):
            found = entities.get(name.casefold())
            if found is None:
                found = await upsert_entity(session, brain, name, "other", evidence=source)
                entities[name.casefold()] = found
            ends.append(found)
        await add_relation(session, brain, ends[0], relation.relation, ends[1], evidence=source)
    if index is not None:
        if written is not None:
            await index.add(session, brain, "episodes", [(written.id, written.text)])
        new_facts = {c.fact.id: c.fact.text for c in changes if c.action != "merged"}
        await index.add(session, brain, "knowledge", list(new_facts.items()))
        await index.add(
            session,
            brain,
            "social",
            [(e.id, entity_text(e)) for e in entities.values()],
        )
    if extraction.soul is not None and extraction.soul.strip():
        await revise_soul(session, brain, extraction.soul, source="learning", trajectory_id=item.id)
