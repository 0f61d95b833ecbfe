"""Redis restarts empty: nothing acknowledged is lost.

The engine runs on a Redis server of its own here (the redis-server binary
the embedded mode ships), without persistence, so killing it loses
everything it held: streams, groups, locks, the hot event logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import EventRecord
from httpx_sse import aconnect_sse
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing import RedisServer
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute, replay
from tests.taskids import engine_task_id
from tests.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def volatile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis that keeps nothing: killed and started again, it is empty."""
    server = RedisServer(tmp_path_factory.mktemp("volatile-redis"), durable=False)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def lossy_engine(
    volatile: RedisServer,
    database_url: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(volatile.url, database_url, "lossy:", HOLDFAST_LEASE_SECONDS="2")
    with running_engine(env, directory=tmp_path_factory.mktemp("lossy")) as procs:
        yield procs


async def follow(
    client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any], seen: list[dict[str, Any]]
) -> None:
    """Read a POST stream into ``seen`` until it ends or breaks."""
    async with aconnect_sse(
        client, "POST", f"{url}/execute", json=body, headers={"X-Engine-Key": key}
    ) as source:
        async for sse in source.aiter_sse():
            if sse.event != "heartbeat":
                seen.append(json.loads(sse.data))


async def _streaming(seen: list[dict[str, Any]], *, following: asyncio.Task[None]) -> bool:
    assert not following.done(), f"the stream ended before the loss: {seen}"
    return any(e["type"] == "text_delta" for e in seen)


def script(**kw: Any) -> str:
    return "/script " + json.dumps(kw)


async def test_redis_restarting_empty_loses_nothing_acknowledged(
    lossy_engine: EngineProcesses,
    volatile: RedisServer,
    api_keys: dict[str, str],
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    key = api_keys["main"]
    url = lossy_engine.url
    async with httpx.AsyncClient(timeout=30) as client:
        done = await execute(client, url, key, {"message": "kept forever"})
        done_task = done.headers["x-task-id"]
        engine_id = await engine_task_id(sessions, done_task)

        async def archived() -> bool:  # what the empty Redis must not lose
            async with sessions() as session:
                last = await session.scalar(
                    select(func.max(EventRecord.seq)).where(EventRecord.task_id == engine_id)
                )
            return last is not None and last >= done.events[-1]["seq"]

        await until(archived, "the first task's log never reached PostgreSQL")

        task_id = f"lossy-{secrets.token_hex(3)}"
        seen: list[dict[str, Any]] = []
        slow = asyncio.create_task(
            follow(
                client,
                url,
                key,
                {"message": script(text="r ", deltas=80, delay_ms=50), "task_id": task_id},
                seen,
            )
        )
        # Lost while the model streams: after the turn was accepted, before its end.
        await until(lambda: _streaming(seen, following=slow), "the turn never streamed", within=30)
        volatile.kill()
        volatile.start()  # empty: no streams, no groups, no locks
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            await asyncio.wait_for(slow, 30)
        assert seen and seen[0]["phase"] == "started", "the turn was accepted before the loss"
        started_ts = seen[0]

        # The interrupted turn is rebuilt from PostgreSQL and finishes; a
        # client following it by timestamp sees it through to the end.
        deadline = time.monotonic() + 60
        while True:
            rest = await replay(
                client, url, key, {"task_id": task_id, "after": started_ts["timestamp"]}
            )
            if rest.events and rest.events[-1]["type"] == "thread_lifecycle":
                break
            assert time.monotonic() < deadline, "the turn never finished"
            await asyncio.sleep(0.5)
        full_done = await replay(client, url, key, {"task_id": done_task, "after": 0})
        full_slow = await replay(client, url, key, {"task_id": task_id, "after": 0})
        again = await execute(client, url, key, {"message": "still here", "task_id": done_task})

    assert full_done.events == done.events, "the archived log is served in full"
    assert rest.events[-1]["phase"] == "completed"
    # The rebuilt log is whole: numbered on from what PostgreSQL had, one
    # start, one end, timestamps strictly increasing. (Events the lost Redis
    # held but had not archived yet are gone; a timestamp cursor, as used
    # above, still reaches everything that followed.)
    log = full_slow.events
    assert [e["seq"] for e in log] == list(range(1, len(log) + 1))
    stamps = [e["timestamp"] for e in log]
    assert stamps == sorted(set(stamps))
    assert [e.get("phase") for e in log if e["type"] == "thread_lifecycle"] == [
        "started",
        "completed",
    ]
    assert rest.events == [e for e in log if e["timestamp"] > started_ts["timestamp"]]
    assert again.events[0]["seq"] == done.events[-1]["seq"] + 1
    assert again.events[-1]["phase"] == "completed"
