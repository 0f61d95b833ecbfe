"""Redis goes away for a moment and comes back with its data: a turn goes on.

A Redis that is restarting refuses connections, and one that has just
started answers ``LOADING`` (BusyLoadingError) until its file is read: both
are transient, and neither may end a user's turn. The engine runs here on a
durable Redis of its own (the embedded server's binary, AOF), which the test
kills and starts again while a turn streams.
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
import redis

from holdfast.testing import RedisServer
from tests.conftest import engine_env
from tests.e2e.test_redis_loss import follow
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import replay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

# Keys of ballast in the Redis's file: about a second of loading on a 2-core VM.
LOADING_KEYS = 1_000_000


@pytest.fixture(scope="module")
def durable(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis whose file takes a while to load: started again, it answers
    LOADING for a moment before it serves."""
    server = RedisServer(tmp_path_factory.mktemp("durable-redis"), durable=True)
    server.start()
    client = redis.Redis.from_url(server.url)
    client.execute_command("DEBUG", "POPULATE", LOADING_KEYS, "ballast", 64)
    client.bgrewriteaof()
    while client.info("persistence")["aof_rewrite_in_progress"]:
        time.sleep(0.05)  # the set-up's own wait, not a scenario's
    client.close()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def restarting_engine(
    durable: RedisServer,
    database_url: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(durable.url, database_url, "restart:", HOLDFAST_LEASE_SECONDS="2")
    with running_engine(env, directory=tmp_path_factory.mktemp("restarting")) as procs:
        yield procs


async def test_a_turn_outlives_a_redis_restart(
    restarting_engine: EngineProcesses, durable: RedisServer, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    url = restarting_engine.url
    task_id = f"restart-{secrets.token_hex(3)}"
    script = "/script " + json.dumps({"text": "r ", "deltas": 80, "delay_ms": 40})
    seen: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=30) as client:
        following = asyncio.create_task(
            follow(client, url, key, {"message": script, "task_id": task_id}, seen)
        )
        # Redis dies while the model streams: after the turn's first deltas.
        deadline = time.monotonic() + 60
        while sum(e["type"] == "text_delta" for e in seen) < 5:
            assert not following.done(), seen
            assert time.monotonic() < deadline, "the turn never streamed"
            await asyncio.sleep(0.05)
        durable.kill()
        await asyncio.sleep(0.3)  # refused meanwhile, then LOADING while it reads its file
        await asyncio.to_thread(durable.start)
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            await asyncio.wait_for(following, 30)

        deadline = time.monotonic() + 90
        while True:
            with contextlib.suppress(httpx.HTTPError):
                got = await replay(client, url, key, {"task_id": task_id, "after_seq": 0})
                ends = [e for e in got.events if e["type"] == "thread_lifecycle"]
                if ends and ends[-1]["phase"] in ("completed", "errored", "cancelled"):
                    break
            assert time.monotonic() < deadline, "the turn never ended"
            await asyncio.sleep(0.5)

    phases = [e["phase"] for e in got.events if e["type"] == "thread_lifecycle"]
    assert phases[0] == "started" and phases[-1] == "completed", phases
    assert not [e for e in got.events if e["type"] == "error"]
    assert [e["seq"] for e in got.events] == list(range(1, len(got.events) + 1))
    # The worker never took the restart for the turn's failure (whether or not
    # its error could have been logged while Redis was away).
    worker_log = restarting_engine.workers[0].log.read_text()
    assert f"turn {got.events[0]['turn_id']} failed" not in worker_log
