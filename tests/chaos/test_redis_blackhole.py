"""A Redis that goes silent for longer than every timeout (issue #29): the
loop-worker and the gateway notice within their socket timeout
(``HOLDFAST_REDIS_SOCKET_TIMEOUT_SECONDS``) instead of waiting on a dead
connection for ever, and work again once Redis answers."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from holdfast.testing import FaultProxy, scaled
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SOCKET_TIMEOUT = 6


@pytest.fixture(scope="module")
def redis_proxy(redis_url: str) -> Iterator[FaultProxy]:
    parts = urlsplit(redis_url)
    if not parts.port:
        pytest.skip("a TCP Redis is needed for the fault proxy")
    with FaultProxy(parts.hostname or "127.0.0.1", parts.port) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def engine(
    redis_url: str,
    database_url: str,
    redis_proxy: FaultProxy,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_proxy.url_for(redis_url),
        database_url,
        f"blackhole{secrets.token_hex(2)}:",
        HOLDFAST_REDIS_SOCKET_TIMEOUT_SECONDS=str(SOCKET_TIMEOUT),
        HOLDFAST_REDIS_CONNECT_TIMEOUT_SECONDS="2",
        HOLDFAST_REQUEST_TIMEOUT_SECONDS="3",
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("blackhole")) as procs:
        yield procs


async def _turn(engine: EngineProcesses, key: str) -> list[str]:
    """A short scripted turn from POST to its end; its lifecycle phases."""
    script = "/script " + json.dumps({"text": "b ", "deltas": 5, "delay_ms": 10})
    body = {"message": script, "task_id": f"blackhole-{secrets.token_hex(3)}"}
    async with httpx.AsyncClient(timeout=scaled(60)) as client:
        got = await stream(client, "POST", f"{engine.url}/execute", key=key, json=body)
    return [e["phase"] for e in got.events if e["type"] == "thread_lifecycle"]


def _grown(log: Path, since: int, text: str) -> bool:
    with log.open("rb") as f:
        f.seek(since)
        return text.encode() in f.read()


async def test_a_silent_redis_is_noticed_and_outlived(
    engine: EngineProcesses, redis_proxy: FaultProxy, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    assert (await _turn(engine, key))[-1] == "completed"
    worker, gateway = engine.workers[0], engine.gateways[0]
    marks = {p.log: p.log.stat().st_size for p in (worker, gateway)}

    redis_proxy.set(blackhole=True)
    began = time.monotonic()
    # The worker's group read and the gateway's tail each block for at most
    # 5 s; a reply that does not come within the socket timeout is noticed.
    noticed = {worker.log: "Redis unreachable", gateway.log: "event tailer read failed"}
    while not all(_grown(log, marks[log], text) for log, text in noticed.items()):
        waited = time.monotonic() - began
        assert waited < SOCKET_TIMEOUT + 5 + scaled(10), (
            f"not noticed after {waited:.1f} s: "
            + ", ".join(t for log, t in noticed.items() if not _grown(log, marks[log], t))
        )
        await asyncio.sleep(0.2)
    noticed_after = time.monotonic() - began
    # Silent longer than every timeout, then back with the stalled connections
    # gone (as after a failover to a new host at the same address).
    await asyncio.sleep(max(0.0, 2 * SOCKET_TIMEOUT - noticed_after))
    redis_proxy.reset_all()
    redis_proxy.heal()
    assert worker.alive and gateway.alive

    healed = time.monotonic()
    while True:
        try:
            phases = await _turn(engine, key)
        except (httpx.HTTPError, AssertionError):
            phases = []
        if phases and phases[-1] == "completed":
            break
        assert time.monotonic() - healed < scaled(60), phases
        await asyncio.sleep(1)
    print(
        f"noticed after {noticed_after:.1f} s; a turn ran {time.monotonic() - healed:.1f} s after"
    )
