"""The learning centre killed mid-batch loses and duplicates nothing."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest
from holdfast_shared.db.models import Episode, Fact, TrajectoryRecord
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute

Sessions = async_sessionmaker[AsyncSession]
TURNS = 24


@pytest.fixture(scope="module")
def slow_learner(
    redis_url: str, database_url: str, redis_prefix: str, api_keys: dict[str, str]
) -> Iterator[EngineProcesses]:
    """An engine whose extraction takes 150 ms a trajectory, in batches of 8."""
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}learnchaos:",
        SCRIPTED_EXTRACTION_DELAY_MS="150",
        HOLDFAST_LEARNING_BATCH_SIZE="8",
        HOLDFAST_LEARNING_CLAIM_IDLE_SECONDS="1",
    )
    with running_engine(env, workers=1, learners=1) as procs:
        yield procs


async def status_counts(sessions: Sessions, ids: list[str]) -> dict[str, int]:
    async with sessions() as session:
        rows = await session.execute(
            select(TrajectoryRecord.status, func.count())
            .where(TrajectoryRecord.id.in_(ids))
            .group_by(TrajectoryRecord.status)
        )
    return {status: count for status, count in rows.all()}


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_a_learner_killed_mid_batch_loses_and_duplicates_nothing(
    slow_learner: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    user = f"u-{secrets.token_hex(4)}"
    async with httpx.AsyncClient(timeout=60) as client:
        turns = await asyncio.gather(
            *(
                execute(
                    client,
                    slow_learner.url,
                    api_keys["main"],
                    {"message": f"My parcel number {n} went to depot {n * 7}.", "user_id": user},
                )
                for n in range(TURNS)
            )
        )
    ids = [str(t.events[0]["turn_id"]) for t in turns]
    # Kill it once some, not all, are learned: it holds a batch in flight.
    deadline = time.monotonic() + 60
    while (await status_counts(sessions, ids)).get("done", 0) < 3:
        assert time.monotonic() < deadline, "the learner never started"
        await asyncio.sleep(0.05)
    (learner,) = slow_learner.of("learning")
    slow_learner.kill(learner)
    assert (await status_counts(sessions, ids)).get("done", 0) < TURNS
    slow_learner.start_learning()
    while (await status_counts(sessions, ids)).get("done", 0) < TURNS:
        assert time.monotonic() < deadline + 60, await status_counts(sessions, ids)
        await asyncio.sleep(0.1)
    async with sessions() as session:
        episodes = (
            await session.execute(
                select(Episode.trajectory_id, func.count())
                .where(Episode.trajectory_id.in_(ids))
                .group_by(Episode.trajectory_id)
            )
        ).all()
        facts = (await session.execute(select(Fact).where(Fact.user_id == user))).scalars().all()
    assert {tid: n for tid, n in episodes} == {tid: 1 for tid in ids}
    assert len(facts) == TURNS
    assert sorted(source for f in facts for source in f.sources) == sorted(ids)
