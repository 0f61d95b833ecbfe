"""Streams survive what connections and processes do: hot and cold resume, many gateways."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
from collections.abc import Iterator

import httpx
import pytest
from holdfast_shared.keys import Keys
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.conftest import engine_env
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute, replay
from tests.taskids import engine_task_id
from tests.waiting import logged, until_logged

pytestmark = pytest.mark.timeout(90)


def script(**kw: object) -> str:
    return "/script " + json.dumps(kw)


@pytest.fixture(scope="module")
def short_ttl_engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """An engine whose Redis copy of a log expires 1 s after it is archived."""
    env = engine_env(
        redis_url, database_url, f"{redis_prefix}ttl:", HOLDFAST_CHANNEL_STATE_TTL_ACTIVE="1"
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("short-ttl")) as procs:
        yield procs


async def wait_until_trimmed(redis: Redis, key: str, patience: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + patience
    while await redis.exists(key):
        assert asyncio.get_running_loop().time() < deadline, "hot copy never expired"
        await asyncio.sleep(0.2)


@pytest.mark.slow
async def test_resume_after_the_hot_copy_was_trimmed(
    short_ttl_engine: EngineProcesses,
    api_keys: dict[str, str],
    redis: Redis,
    redis_prefix: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    key = api_keys["main"]
    url = short_ttl_engine.url
    async with httpx.AsyncClient(timeout=30) as client:
        first = await execute(
            client, url, key, {"message": script(text="w ", deltas=30, delay_ms=20)}, limit=5
        )
        task_id = first.headers["x-task-id"]
        hot = Keys(f"{redis_prefix}ttl:").events(await engine_task_id(sessions, task_id))
        await wait_until_trimmed(redis, hot)

        by_seq = await replay(client, url, key, {"task_id": task_id, "after_seq": 5})
        by_ts = await replay(
            client, url, key, {"task_id": task_id, "after": first.events[-1]["timestamp"]}
        )
        full = await replay(client, url, key, {"task_id": task_id, "after": 0})
        # A new turn after the trim continues the numbering from PostgreSQL.
        second = await execute(client, url, key, {"message": "again", "task_id": task_id})
        everything = await replay(client, url, key, {"task_id": task_id})

    combined = first.events + by_seq.events
    assert [e["seq"] for e in combined] == list(range(1, len(combined) + 1))
    assert combined[-1]["phase"] == "completed"
    assert by_ts.events == by_seq.events
    assert full.events == combined
    assert second.seqs[0] == combined[-1]["seq"] + 1
    assert second.events[0]["timestamp"] > combined[-1]["timestamp"]
    assert everything.events == combined + second.events


@pytest.mark.slow
async def test_two_gateways_serve_one_task(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    other = engine.start("gateway")
    second_url = other.url
    key = api_keys["main"]
    task_id = f"two-gw-{secrets.token_hex(4)}"
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            live = asyncio.create_task(
                execute(
                    client,
                    engine.url,
                    key,
                    {"message": script(text="g ", deltas=40, delay_ms=50), "task_id": task_id},
                )
            )
            # The other gateway follows the turn while it streams, not after it.
            await until_logged(
                client, second_url, key, task_id, logged("text_delta"), "no text on the other"
            )
            assert not live.done(), "the turn ended before the other gateway followed it"
            mirrored = await replay(client, second_url, key, {"task_id": task_id})
            original = await live
    finally:
        engine.kill(other, signal.SIGTERM)
    assert original.events[-1]["phase"] == "completed"
    assert mirrored.events == original.events
