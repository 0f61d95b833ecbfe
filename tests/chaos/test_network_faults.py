"""Network faults between the engine and its servers (issue #29): every service
reaches PostgreSQL and Redis through a :class:`~holdfast.testing.FaultProxy`,
and the test makes the network slow, cuts connections, and partitions it
while a turn streams. The bar is the chaos suite's: the turn ends, completed,
its events gapless in Redis and in PostgreSQL, nothing acknowledged lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import psycopg
import pytest

from holdfast.testing import FaultProxy, scaled
from tests.conftest import engine_env
from tests.e2e.test_redis_loss import follow
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import replay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# The gateway's bound on a request's answer (HOLDFAST_REQUEST_TIMEOUT_SECONDS).
REQUEST_TIMEOUT = 3


def _proxied(url: str) -> FaultProxy:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "postgresql", "postgres") or not parts.port:
        pytest.skip(f"a TCP server is needed for the fault proxy, not {parts.scheme}://")
    return FaultProxy(parts.hostname or "127.0.0.1", parts.port).start()


@pytest.fixture(scope="module")
def pg_proxy(database_url: str) -> Iterator[FaultProxy]:
    proxy = _proxied(database_url)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def redis_proxy(redis_url: str) -> Iterator[FaultProxy]:
    proxy = _proxied(redis_url)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def faulty_engine(
    redis_url: str,
    database_url: str,
    pg_proxy: FaultProxy,
    redis_proxy: FaultProxy,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_proxy.url_for(redis_url),
        pg_proxy.url_for(database_url),
        f"netfault{secrets.token_hex(2)}:",
        HOLDFAST_LEASE_SECONDS="3",
        HOLDFAST_REQUEST_TIMEOUT_SECONDS=str(REQUEST_TIMEOUT),
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("netfaults")) as procs:
        yield procs


@pytest.fixture(autouse=True)
def healed(pg_proxy: FaultProxy, redis_proxy: FaultProxy) -> Iterator[None]:
    yield
    pg_proxy.heal()
    redis_proxy.heal()


async def _turn_under(
    engine: EngineProcesses,
    key: str,
    fault: Any,
    *,
    deltas: int = 60,
) -> list[dict[str, Any]]:
    """Stream a scripted turn, run ``fault`` (an async callable) once it streams,
    then wait until the turn's end is in the log; its replayed events."""
    url = engine.url
    task_id = f"netfault-{secrets.token_hex(3)}"
    script = "/script " + json.dumps({"text": "n ", "deltas": deltas, "delay_ms": 30})
    seen: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=30) as client:
        following = asyncio.create_task(
            follow(client, url, key, {"message": script, "task_id": task_id}, seen)
        )
        deadline = time.monotonic() + scaled(60)
        while sum(e["type"] == "text_delta" for e in seen) < 5:
            assert not following.done(), seen
            assert time.monotonic() < deadline, "the turn never streamed"
            await asyncio.sleep(0.05)
        await fault()
        with contextlib.suppress(httpx.HTTPError, TimeoutError):
            await asyncio.wait_for(following, scaled(60))
        deadline = time.monotonic() + scaled(120)
        while True:
            with contextlib.suppress(httpx.HTTPError):
                got = await replay(client, url, key, {"task_id": task_id, "after_seq": 0})
                ends = [e for e in got.events if e["type"] == "thread_lifecycle"]
                if ends and ends[-1]["phase"] in ("completed", "errored", "cancelled"):
                    return got.events
            assert time.monotonic() < deadline, "the turn never ended"
            await asyncio.sleep(0.5)


def _assert_whole(events: list[dict[str, Any]], deltas: int = 60) -> None:
    phases = [e["phase"] for e in events if e["type"] == "thread_lifecycle"]
    assert phases[0] == "started" and phases[-1] == "completed", phases
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert sum(e["type"] == "text_delta" for e in events) >= deltas


async def _archived(database_url: str, task_name: str, last_seq: int) -> list[int]:
    """The task's seqs in PostgreSQL once the event copier caught up with ``last_seq``."""
    deadline = time.monotonic() + scaled(60)
    while True:
        async with await psycopg.AsyncConnection.connect(database_url) as conn:
            rows = await conn.execute(
                "SELECT e.seq FROM events e JOIN tasks t ON t.id = e.task_id "
                "WHERE t.name = %s ORDER BY e.seq",
                (task_name,),
            )
            seqs = [r[0] for r in await rows.fetchall()]
        if seqs and seqs[-1] >= last_seq:
            return seqs
        assert time.monotonic() < deadline, f"archived up to {seqs[-1:]} of {last_seq}"
        await asyncio.sleep(0.2)


async def test_slow_postgresql_and_redis(
    faulty_engine: EngineProcesses,
    pg_proxy: FaultProxy,
    redis_proxy: FaultProxy,
    api_keys: dict[str, str],
) -> None:
    """Every chunk to and from both servers 100 ms late (200 ms a round trip)."""

    async def slow() -> None:
        pg_proxy.set(latency_ms=100)
        redis_proxy.set(latency_ms=100)

    events = await _turn_under(faulty_engine, api_keys["main"], slow)
    _assert_whole(events)


async def test_postgresql_connections_cut_again_and_again(
    faulty_engine: EngineProcesses,
    pg_proxy: FaultProxy,
    database_url: str,
    api_keys: dict[str, str],
) -> None:
    """Every PostgreSQL connection reset with an RST, five times, while the turn
    streams: pools reconnect, the event copier goes on, the log stays gapless."""

    cut_connections: list[int] = []

    async def cut() -> None:
        for _ in range(5):
            cut_connections.append(pg_proxy.reset_all())
            await asyncio.sleep(0.3)

    events = await _turn_under(faulty_engine, api_keys["main"], cut)
    _assert_whole(events)
    assert sum(cut_connections) > 0, "the engine had no PostgreSQL connection to cut"
    seqs = await _archived(database_url, events[0]["task_id"], events[-1]["seq"])
    assert seqs == list(range(1, events[-1]["seq"] + 1))


async def test_redis_connections_cut(
    faulty_engine: EngineProcesses,
    redis_proxy: FaultProxy,
    api_keys: dict[str, str],
) -> None:
    """Every Redis connection reset, three times, mid-turn."""

    cut_connections: list[int] = []

    async def cut() -> None:
        for _ in range(3):
            cut_connections.append(redis_proxy.reset_all())
            await asyncio.sleep(0.5)

    events = await _turn_under(faulty_engine, api_keys["main"], cut)
    _assert_whole(events)
    assert sum(cut_connections) > 0, "the engine had no Redis connection to cut"


async def test_postgresql_partitioned_for_seconds(
    faulty_engine: EngineProcesses,
    pg_proxy: FaultProxy,
    database_url: str,
    api_keys: dict[str, str],
) -> None:
    """PostgreSQL unreachable without a word (a blackhole: nothing refused,
    nothing answered) for several seconds, then back: the turn completes and
    its log in PostgreSQL is gapless."""

    async def partition() -> None:
        pg_proxy.set(blackhole=True)
        await asyncio.sleep(6)
        pg_proxy.heal()

    events = await _turn_under(faulty_engine, api_keys["main"], partition)
    _assert_whole(events)
    seqs = await _archived(database_url, events[0]["task_id"], events[-1]["seq"])
    assert seqs == list(range(1, events[-1]["seq"] + 1))


async def test_the_gateway_answers_503_while_postgresql_is_silent(
    faulty_engine: EngineProcesses,
    pg_proxy: FaultProxy,
    api_keys: dict[str, str],
) -> None:
    """A POST that needs PostgreSQL while it answers nothing gets a retryable
    503 within the request timeout, not a hang; once it answers again, the
    same POST runs (the gateway's pool was not left poisoned)."""
    key = api_keys["main"]
    url = faulty_engine.url
    body = {"message": "hello", "task_id": f"netfault-{secrets.token_hex(3)}"}
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(timeout=scaled(60)) as client:
        pg_proxy.set(blackhole=True)
        began = time.monotonic()
        reply = await client.post(f"{url}/execute", json=body, headers=headers)
        waited = time.monotonic() - began
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"] == "UNAVAILABLE"
        assert int(reply.headers["retry-after"]) > 0
        assert waited < REQUEST_TIMEOUT + scaled(5), waited
        pg_proxy.heal()
        deadline = time.monotonic() + scaled(60)
        while True:
            reply = await client.post(f"{url}/execute", json=body, headers=headers)
            if reply.status_code == 200:
                break
            assert reply.status_code == 503, reply.text
            assert time.monotonic() < deadline, "the gateway never recovered"
            await asyncio.sleep(float(reply.headers["retry-after"]))
    assert '"phase":"completed"' in reply.text.replace(" ", "")


async def test_redis_partitioned_for_seconds(
    faulty_engine: EngineProcesses,
    redis_proxy: FaultProxy,
    api_keys: dict[str, str],
) -> None:
    """Redis answers nothing for several seconds mid-turn (the workers' leases,
    in PostgreSQL, outlive it): the turn goes on where it was, gapless."""

    async def partition() -> None:
        redis_proxy.set(blackhole=True)
        await asyncio.sleep(6)
        redis_proxy.heal()

    events = await _turn_under(faulty_engine, api_keys["main"], partition)
    _assert_whole(events)


async def test_connections_cut_at_random_offsets(
    faulty_engine: EngineProcesses,
    pg_proxy: FaultProxy,
    redis_proxy: FaultProxy,
    database_url: str,
    api_keys: dict[str, str],
) -> None:
    """Every new connection to either store is cut after a random 2-64 KiB, and
    the open ones are cut to make them new, while a turn streams: every
    reconnect meets the next cut."""

    async def flaky() -> None:
        pg_proxy.set(reset_after=(2048, 65536))
        redis_proxy.set(reset_after=(2048, 65536))
        pg_proxy.reset_all()
        redis_proxy.reset_all()
        await asyncio.sleep(3)
        pg_proxy.heal()
        redis_proxy.heal()

    events = await _turn_under(faulty_engine, api_keys["main"], flaky)
    _assert_whole(events)
    seqs = await _archived(database_url, events[0]["task_id"], events[-1]["seq"])
    assert seqs == list(range(1, events[-1]["seq"] + 1))
    assert pg_proxy.cut + redis_proxy.cut > 0
