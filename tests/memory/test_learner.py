"""The learner in process, on the real PostgreSQL and Redis: retries, dead letters,
idempotence, retention — with the clock moved instead of waited for."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from holdfast_learning.extract import Extracted, Extractor, parse, render
from holdfast_learning.learner import Learner
from holdfast_learning.missed_sweep import due_trajectories, sweep
from holdfast_learning.trajectory_retention import (
    archive_trajectories,
    day_file,
    delete_old_archives,
    read_day,
)
from holdfast_shared.db.models import Episode, Fact, SoulVersion, TrajectoryRecord
from holdfast_shared.keys import Keys
from holdfast_shared.providers import ProviderRegistry
from holdfast_shared.providers.scripted import ScriptedProvider
from holdfast_shared.providers.scripted_learning import FAIL_MARK
from redis.asyncio import Redis
from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

Sessions = async_sessionmaker[AsyncSession]


def record(*user_messages: str, outcome: str = "completed") -> dict[str, Any]:
    return {
        "version": 1,
        "task": {"id": "tk_x", "name": "x"},
        "turn_id": "turn_x",
        "messages": [
            {"position": i, "role": "user", "content": {"blocks": [{"type": "text", "text": m}]}}
            for i, m in enumerate(user_messages)
        ],
        "tool_calls": [],
        "hitl": [],
        "usage": {},
        "timings": {"started_at": "2026-11-01T10:00:00+00:00"},
        "outcome": {"status": outcome},
    }


@pytest.fixture
def user() -> str:
    return f"u-{secrets.token_hex(4)}"


@pytest.fixture
async def learner(
    sessions: Sessions, redis: Redis, redis_prefix: str, api_keys: dict[str, str]
) -> AsyncIterator[Learner]:
    keys = Keys(f"{redis_prefix}learner-{secrets.token_hex(3)}:")
    extractor = Extractor(ProviderRegistry([ScriptedProvider()]), None)
    yield Learner(sessions, redis, keys, extractor, max_attempts=2)
    await redis.delete(keys.learning_dead)


async def add_trajectory(
    sessions: Sessions, user: str, body: dict[str, Any], *, finished: datetime | None = None
) -> str:
    trajectory_id = f"turn_{secrets.token_hex(8)}"
    finished = finished or datetime.now(UTC)
    async with sessions.begin() as session:
        session.add(
            TrajectoryRecord(
                id=trajectory_id,
                tenant_id="tenant-main",
                user_id=user,
                task_id="tk_x",
                outcome="completed",
                record=body,
                started_at=finished - timedelta(seconds=1),
                finished_at=finished,
            )
        )
    return trajectory_id


async def test_a_trajectory_is_learned_once(
    learner: Learner, sessions: Sessions, user: str
) -> None:
    tid = await add_trajectory(sessions, user, record("My bike is a red Brompton."))
    first = await learner.learn([tid, tid])
    again = await learner.learn([tid])
    assert (first.learned, again.learned, again.skipped) == (1, 0, 1)
    async with sessions() as session:
        facts = (await session.execute(select(Fact).where(Fact.user_id == user))).scalars().all()
        episodes = await session.scalar(
            select(func.count()).select_from(Episode).where(Episode.trajectory_id == tid)
        )
    assert [f.text for f in facts] == ["The user's bike is a red Brompton."]
    assert facts[0].sources == [tid] and episodes == 1


async def test_a_failing_trajectory_is_retried_with_backoff_then_dead_lettered(
    learner: Learner, sessions: Sessions, redis: Redis, user: str
) -> None:
    tid = await add_trajectory(sessions, user, record(f"This one breaks {FAIL_MARK}."))
    result = await learner.learn([tid])
    assert result.failed == 1
    async with sessions() as session:
        row = await session.get(TrajectoryRecord, tid)
    assert row is not None and row.attempts == 1 and row.status == "pending"
    assert row.last_error and "scripted extraction failure" in row.last_error
    assert row.next_attempt_at is not None
    now = datetime.now(UTC)
    # Not due yet: an early announcement does not retry it, nor does the sweep.
    assert (await learner.learn([tid])).skipped == 1
    assert tid not in await due_trajectories(sessions, now)
    later = row.next_attempt_at + timedelta(seconds=1)
    assert tid in await due_trajectories(sessions, later)
    swept = await sweep(sessions, learner, later)
    assert swept.dead >= 1
    async with sessions() as session:
        row = await session.get(TrajectoryRecord, tid)
    assert row is not None and row.status == "dead" and row.attempts == 2
    assert tid in await redis.lrange(learner.keys.learning_dead, 0, -1)


async def test_a_lost_announcement_is_learned_by_the_sweep(
    learner: Learner, sessions: Sessions, user: str
) -> None:
    finished = datetime.now(UTC)
    tid = await add_trajectory(sessions, user, record("Our office is in Leeds."), finished=finished)
    assert tid not in await due_trajectories(sessions, finished + timedelta(seconds=5))
    later = finished + timedelta(minutes=3)
    assert tid in await due_trajectories(sessions, later)
    await sweep(sessions, learner, later)
    async with sessions() as session:
        row = await session.get(TrajectoryRecord, tid)
    assert row is not None and row.status == "done"


async def test_a_trajectory_learned_late_does_not_overrule_a_newer_fact(
    learner: Learner, sessions: Sessions, user: str
) -> None:
    now = datetime.now(UTC)
    old = await add_trajectory(
        sessions, user, record("My laptop is a ThinkPad."), finished=now - timedelta(hours=1)
    )
    new = await add_trajectory(sessions, user, record("My laptop is a MacBook."), finished=now)
    await learner.learn([new])
    await learner.learn([old])  # a retry that succeeded only now
    async with sessions() as session:
        current = (
            await session.execute(select(Fact).where(Fact.user_id == user, Fact.valid_to.is_(None)))
        ).scalar_one()
        older = (
            await session.execute(
                select(Fact).where(Fact.user_id == user, Fact.valid_to.is_not(None))
            )
        ).scalar_one()
    assert current.text == "The user's laptop is a MacBook."
    assert older.text == "The user's laptop is a ThinkPad." and older.superseded_by == current.id


async def test_the_soul_is_revised_and_every_version_kept(
    learner: Learner, sessions: Sessions, user: str
) -> None:
    for said in ("I prefer tea.", "I prefer tea. I always write tests first.", "I prefer tea."):
        await learner.learn([await add_trajectory(sessions, user, record(said))])
    async with sessions() as session:
        versions = (
            await session.execute(
                select(SoulVersion.version, SoulVersion.content)
                .where(SoulVersion.user_id == user)
                .order_by(SoulVersion.version)
            )
        ).all()
    assert [v.content for v in versions] == [
        "- The user prefers tea.",
        "- The user prefers tea.\n- The user always writes tests first.",
    ]


def test_the_rendered_trajectory_carries_what_the_extractor_needs() -> None:
    body = record("Hello there, I live in Oslo.")
    body["hitl"] = [
        {"kind": "permission", "question": "Allow bash?", "answer": "yes", "status": "answered"}
    ]
    body["outcome"] = {"status": "errored", "error": {"code": "X", "message": "bad"}}
    text = render(body, "- likes tea")
    assert "## Current soul\n- likes tea" in text
    assert "User: Hello there, I live in Oslo." in text
    assert "Outcome: errored" in text and "Error:" in text
    assert "(permission): Allow bash? — answer: yes" in text


async def test_retention_archives_then_deletes_with_a_moved_clock(
    sessions: Sessions, tmp_path: Path, user: str
) -> None:
    now = datetime.now(UTC)
    old = now - timedelta(days=40)
    kept = await add_trajectory(sessions, user, record("recent"), finished=now)
    gone = [
        await add_trajectory(sessions, user, record(f"old {n}"), finished=old) for n in range(3)
    ]
    try:
        moved = await archive_trajectories(sessions, tmp_path, retention_days=30, now=now)
        assert moved >= 3
        archived = read_day(day_file(tmp_path, old.date()))
        assert {item["id"] for item in archived} >= set(gone)
        assert next(i for i in archived if i["id"] == gone[0])["record"]["messages"]
        async with sessions() as session:
            left = set(
                (
                    await session.execute(
                        select(TrajectoryRecord.id).where(TrajectoryRecord.user_id == user)
                    )
                ).scalars()
            )
        assert left == {kept}
        # Run again (as after a crash between writing and deleting): nothing doubles.
        assert await archive_trajectories(sessions, tmp_path, retention_days=30, now=now) == 0
        assert len(read_day(day_file(tmp_path, old.date()))) == len(archived)
        # A year on, the day file goes too.
        assert await delete_old_archives(tmp_path, archive_days=365, now=now) == 0
        assert (
            await delete_old_archives(tmp_path, archive_days=365, now=now + timedelta(days=330))
            >= 1
        )
        assert not day_file(tmp_path, old.date()).exists()
    finally:
        async with sessions.begin() as session:
            await session.execute(delete(TrajectoryRecord).where(TrajectoryRecord.user_id == user))


class _EchoingExtractor(Extractor):
    """A model that quotes the trajectory back in an invalid extraction: the
    validation error then holds the trajectory's words, as a provider's error
    echoing the prompt would."""

    async def extract(self, record: dict[str, Any], soul: str) -> Extracted:
        quoted = render(record, soul)
        parse(json.dumps({"episode": {"summary": quoted, "outcome": quoted}}), "")
        raise AssertionError("the quoted reply is too long to be valid")


async def test_a_failed_extraction_logs_ids_and_the_error_class_never_content(
    sessions: Sessions,
    redis: Redis,
    redis_prefix: str,
    user: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    keys = Keys(f"{redis_prefix}learner-{secrets.token_hex(3)}:")
    extractor = _EchoingExtractor(ProviderRegistry([ScriptedProvider()]), None)
    learner = Learner(sessions, redis, keys, extractor, max_attempts=1)
    marker = f"secret-{secrets.token_hex(8)}"
    tid = await add_trajectory(sessions, user, record(f"Run rm -rf /srv/{marker} " * 40))
    with caplog.at_level(logging.DEBUG):
        result = await learner.learn([tid])
    await redis.delete(keys.learning_dead)
    assert result.dead == 1
    assert tid in caplog.text and "ExtractionFailed" in caplog.text
    assert marker not in caplog.text
    async with sessions() as session:
        row = await session.get(TrajectoryRecord, tid)
    assert row is not None and row.last_error and marker in row.last_error, "kept with the row"
