"""A worker that died before renewing its turn's lease once: the turn is taken over when
the lease runs out, not a whole lease later (the default 10 s lease, real processes)."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Turn
from holdfast_shared.jobs import TurnJob
from holdfast_shared.keys import TURNS_GROUP, Keys
from redis.asyncio import Redis
from sqlalchemy import select, update

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

LEASE_LEFT = 2.5


@pytest.fixture
def engine_without_workers(
    redis_url: str, database_url: str, redis_prefix: str, tmp_path: Path
) -> Iterator[tuple[EngineProcesses, Keys]]:
    prefix = f"{redis_prefix}takeover-{secrets.token_hex(3)}:"
    env = engine_env(redis_url, database_url, prefix)
    with running_engine(env, workers=1, directory=tmp_path) as procs:
        # The worker made the consumer group and advertised the scripted model; it
        # dies now, so the next turn's job waits in the stream.
        procs.kill(procs.workers[0])
        yield procs, Keys(prefix)


async def test_a_lease_that_lapses_soon_is_waited_for_not_skipped(
    engine_without_workers: tuple[EngineProcesses, Keys],
    api_keys: dict[str, str],
    redis: Redis,
    sessions: Any,
) -> None:
    procs, keys = engine_without_workers
    message = "/script " + json.dumps({"text": "taken over"})
    async with httpx.AsyncClient(timeout=60) as client:
        turn = asyncio.create_task(
            execute(client, procs.url, api_keys["main"], {"message": message})
        )
        # A worker took the job and, a moment later, its lease; then it died before
        # renewing either. Below, the job has been idle for a lease (11 s) while the
        # lease still has 2.5 s to run: the stream offers the job before the lease ends.
        reply: list[Any] = []
        for _ in range(200):
            reply = await redis.xreadgroup(
                TURNS_GROUP, "dead-worker", {keys.turns: ">"}, count=1, block=50
            )
            if reply:
                break
        assert reply, "the turn's job never reached the stream"
        entry_id, fields = reply[0][1][0]
        turn_id = TurnJob.from_fields(fields).turn_id

        async def lease_ends_in(seconds: float) -> None:
            async with sessions.begin() as session:
                await session.execute(
                    update(Turn)
                    .where(Turn.id == turn_id)
                    .values(
                        status="running",
                        lease_owner="dead-worker",
                        lease_until=datetime.now(UTC) + timedelta(seconds=seconds),
                    )
                )

        await lease_ends_in(120)  # nobody takes it while the new worker starts
        await asyncio.to_thread(procs.start_worker)
        # Now the job has been idle for a lease (11 s), and the lease has 2.5 s left.
        await lease_ends_in(LEASE_LEFT)
        await redis.xclaim(
            keys.turns, TURNS_GROUP, "dead-worker", 0, [entry_id], idle=11_000, justid=True
        )
        started = time.monotonic()
        got = await asyncio.wait_for(turn, 30)
        elapsed = time.monotonic() - started
    assert got.events[-1]["type"] == "thread_lifecycle"
    assert got.events[-1]["phase"] == "completed"
    assert "taken over" in got.text
    # The 2.5 s left of the lease (+ up to 1 s until the worker looks); a skipped
    # offer would wait for the job to be idle for another whole lease (10 s).
    assert elapsed < 6, f"took {elapsed:.1f} s"
    async with sessions() as session:
        owner = await session.scalar(select(Turn.lease_owner).where(Turn.id == turn_id))
    assert owner != "dead-worker"
