"""``holdfast.testing``: the harness users test their agents with, through its public API.

Real servers (the session's Redis and PostgreSQL server, or the
environment's own), real processes; each test checks what the harness
promises: readiness by the one rule, kills, Redis restarts, and a close that
leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import psycopg
import pytest
import redis
from holdfast_shared.keys import Keys
from sqlalchemy.engine import make_url

from holdfast.testing import EngineEnvironment, NotReady, Process
from holdfast.testing.database import libpq_url
from holdfast.testing.readiness import gateway_healthy
from holdfast.testing.workspaces import mounts_under

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def turn(url: str, key: str, message: str, task_id: str) -> list[dict[str, Any]]:
    """POST one message and read its stream to the end; the events."""
    response = httpx.post(
        f"{url}/execute",
        headers={"X-Engine-Key": key},
        json={"message": message, "task_id": task_id},
        timeout=90,
    )
    assert response.status_code == 200, response.text
    return [
        json.loads(line.removeprefix("data:"))
        for line in response.text.splitlines()
        if line.startswith("data:") and '"seq"' in line
    ]


def completed(events: list[dict[str, Any]]) -> bool:
    return events[-1]["type"] == "thread_lifecycle" and events[-1]["phase"] == "completed"


def exists(redis_url: str, key: str) -> bool:
    with redis.Redis.from_url(redis_url) as client:
        return bool(client.exists(key))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_each_kind_is_ready_by_its_own_registration_and_replaced_after_a_kill(
    redis_url: str, postgres_url: str, tmp_path: Path
) -> None:
    with EngineEnvironment(
        redis_url=redis_url, postgres_url=postgres_url, directory=tmp_path
    ) as engine:
        keys = Keys(engine.prefix)
        runner = engine.start("tool-runner")
        worker = engine.start("loop-worker")
        gateway = engine.start("gateway")
        assert runner.ready and worker.ready and gateway.ready
        assert exists(redis_url, keys.runner_alive(runner.ident))
        assert exists(redis_url, keys.worker_alive(worker.ident))
        assert gateway.url == engine.url and gateway_healthy(engine.url)
        assert completed(turn(engine.url, engine.api_key, "hello", "t-1"))

        assert engine.kill(worker) == -signal.SIGKILL
        assert gone(worker.pid) and engine.of("loop-worker") == []
        replacement = engine.start("loop-worker")
        assert replacement.ident != worker.ident
        assert completed(turn(engine.url, engine.api_key, "again", "t-1"))

        # A clean stop withdraws the registration at once (a kill leaves it to lapse).
        assert engine.kill(replacement, signal.SIGTERM) == 0
        assert not exists(redis_url, keys.worker_alive(replacement.ident))
        for kind in ("gateway", "loop-worker", "tool-runner"):
            assert (engine.log_dir / f"{kind}-1.log").stat().st_size > 0


def test_a_process_that_exits_or_hangs_is_not_ready_and_is_reaped(
    redis_url: str, postgres_url: str, tmp_path: Path
) -> None:
    with EngineEnvironment(
        redis_url=redis_url, postgres_url=postgres_url, directory=tmp_path
    ) as engine:
        with pytest.raises(NotReady, match="exited with 3"):
            engine.start("gateway", command=[sys.executable, "-c", "raise SystemExit(3)"])
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        with pytest.raises(NotReady, match="not ready in 1 s"):
            engine.start("loop-worker", command=sleeper, within=1)
        assert engine.processes == []
        # Both were reaped: no zombie is left among this process's children.
        assert all(c.status() != psutil.STATUS_ZOMBIE for c in psutil.Process().children())
        logs = sorted(p.name for p in engine.log_dir.glob("*.log"))
        assert logs == ["gateway-1.log", "loop-worker-1.log"]


def test_restart_redis_loses_nothing_acknowledged(postgres_url: str, tmp_path: Path) -> None:
    with EngineEnvironment(postgres_url=postgres_url, directory=tmp_path) as engine:
        assert engine.redis is not None
        engine.start("loop-worker")
        engine.start("gateway")
        first = turn(engine.url, engine.api_key, "before", "t-1")
        with redis.Redis.from_url(engine.redis_url) as client:
            client.set(f"{engine.prefix}mark", "kept")
        pid = engine.redis.pid

        engine.restart_redis(outage_seconds=0.5)

        assert engine.redis.pid != pid
        with redis.Redis.from_url(engine.redis_url) as client:
            assert client.get(f"{engine.prefix}mark") == b"kept"
        deadline = time.monotonic() + 60
        while not gateway_healthy(engine.url):
            assert time.monotonic() < deadline, "the gateway never found Redis again"
            time.sleep(0.2)
        second = turn(engine.url, engine.api_key, "after", "t-1")
        assert completed(second)
        assert second[0]["seq"] == first[-1]["seq"] + 1


def test_restart_redis_needs_a_redis_of_its_own(redis_url: str, database_url: str) -> None:
    with EngineEnvironment(redis_url=redis_url, database_url=database_url) as engine:
        with pytest.raises(RuntimeError, match="not its to kill"):
            engine.restart_redis()
        with pytest.raises(ValueError, match="HOLDFAST_REDIS_PREFIX"):
            engine.start("gateway", env={"HOLDFAST_REDIS_PREFIX": "elsewhere:"})


def test_close_leaves_no_process_key_database_mount_or_file(
    redis_url: str, postgres_url: str
) -> None:
    engine = EngineEnvironment(
        redis_url=redis_url,
        postgres_url=postgres_url,
        env={"HOLDFAST_TOOL_PERMISSIONS": json.dumps({"*": {"bash": "allow"}})},
    )
    with engine:
        processes: list[Process] = [
            engine.start("tool-runner"),
            engine.start("loop-worker"),
            engine.start("gateway"),
        ]
        bash = {"name": "bash", "input": {"command": "echo kept > file"}}
        events = turn(
            engine.url, engine.api_key, "/script " + json.dumps({"tool_calls": [bash]}), "t-1"
        )
        assert completed(events)
        assert any(e["type"] == "tool_result" for e in events)
        keyed = {"X-Engine-Key": engine.api_key}
        health = httpx.get(f"{engine.url}/health", headers=keyed).json()
        runners = health["subsystems"]["tool_runners"]
        mounted = any(r.get("workspaces", {}).get("disk") != "none" for r in runners.values())
        if mounted:
            assert mounts_under(engine.workspace_root), "the workspace was not mounted"
        database = make_url(engine.database_url).database
        prefix, directory = engine.prefix, engine.directory

    assert all(gone(p.pid) for p in processes)
    assert engine.processes == []
    with redis.Redis.from_url(redis_url) as client:
        assert not list(client.scan_iter(match=f"{prefix}*"))
    with psycopg.connect(libpq_url(postgres_url)) as conn:
        found = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
        assert found.fetchone() is None
    assert not mounts_under(directory)
    assert not directory.exists()


async def test_until_ready_leaves_the_event_loop_running(redis_url: str, database_url: str) -> None:
    engine = await asyncio.to_thread(
        EngineEnvironment, redis_url=redis_url, database_url=database_url
    )
    try:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(tick())
        worker = engine.start("loop-worker", wait=False)
        await engine.until_ready(worker)
        ticking.cancel()
        assert worker.ready and ticks > 10
    finally:
        await asyncio.to_thread(engine.close)


def test_an_environment_of_its_own_servers(tmp_path: Path) -> None:
    """No URL given: its own Redis and an embedded PostgreSQL, as the README shows."""
    with EngineEnvironment(directory=tmp_path / "env") as engine:
        gateway = engine.start("gateway")
        assert gateway.url is not None and gateway_healthy(gateway.url)
        assert engine.redis is not None and engine.redis.running
    assert not engine.redis.running
