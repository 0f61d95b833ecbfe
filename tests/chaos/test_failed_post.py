"""A POST that failed after its message was committed must not run later.

Found by the chaos run: Redis crashed while a gateway was in ``start_turn``,
after the turn row and the user message were committed to PostgreSQL and
before the ``started`` event was logged. The client got a 503, saw no
``started`` in the task's log and sent the message again, as the protocol
says; a few seconds later the stale-turn sweep queued the half-written turn
as well, so the one message ran twice (and so did its tool call), and the
first of the two turns has no ``started`` event.

Here the append is made to fail deterministically: after the task's first
turn (archived), its event stream key is made to hold a string, so the
append script's XREVRANGE gets WRONGTYPE, exactly where the Redis crash hit
(after the commit, before the ``started`` event).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import aconnect_sse
from redis.asyncio import Redis

from tests.chaos.cluster import ChaosCluster, chaos_env, running_cluster
from tests.chaos.invariants import engine_tasks, pg_rows, workspace
from tests.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
async def cluster(database_url: str, tmp_path: Path) -> AsyncIterator[ChaosCluster]:
    env = chaos_env(database_url, tmp_path / "workspaces")
    async with running_cluster(tmp_path, env, gateways=1, workers=1, runners=1) as c:
        yield c


async def test_a_failed_post_is_not_run_later(
    cluster: ChaosCluster, api_keys: dict[str, str], database_url: str
) -> None:
    key = api_keys["main"]
    url = cluster.gateway_urls()[0]
    task_id = f"failed-post-{time.time_ns()}"
    command = "echo ran >> effects.log"
    message = "/script " + json.dumps(
        {"text": "x", "tool_calls": [{"name": "bash", "input": {"command": command}}]}
    )
    body = {"message": message, "task_id": task_id}
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(timeout=30) as http:
        # The task's first turn, so that its event stream exists and is archived.
        first = await http.post(
            f"{url}/execute", json={"message": "hello", "task_id": task_id}, headers=headers
        )
        assert first.status_code == 200 and '"phase":"completed"' in first.text
        last_seq = first.text.count("\nid: ")
        found = (await engine_tasks(database_url, [task_id]))[task_id]
        for _ in range(100):
            archived = await pg_rows(
                database_url, "SELECT count(*) FROM events WHERE task_id = %s", found[1]
            )
            if archived[0][0] == last_seq:
                break
            await asyncio.sleep(0.05)
        redis = Redis.from_url(cluster.redis.url)
        events_key = f"{cluster.env['HOLDFAST_REDIS_PREFIX']}task:{{{found[1]}}}:events"
        await redis.delete(events_key)
        await redis.set(events_key, "not a stream")
        try:
            # Its own connection: the gateway may drop it after the error.
            async with httpx.AsyncClient(timeout=30) as once:
                failed = await once.post(f"{url}/execute", json=body, headers=headers)
            assert failed.status_code >= 500, failed.text
        except httpx.HTTPError:
            pass  # the connection dropped without a response: also a failed POST
        await redis.delete(events_key)
        await redis.aclose()

        # The client's protocol: no "started" after its cursor means not accepted: send again.
        log = await http.get(
            f"{url}/execute/replay",
            params={"task_id": task_id, "after_seq": last_seq},
            headers=headers,
        )
        assert log.status_code == 200
        assert "thread_lifecycle" not in log.text
        retry_seq = 0
        for _ in range(100):
            async with aconnect_sse(
                http, "POST", f"{url}/execute", json=body, headers=headers
            ) as s:
                if s.response.status_code == 409:
                    await asyncio.sleep(0.3)
                    continue
                assert s.response.status_code == 200
                async for sse in s.aiter_sse():  # to the turn's end
                    if sse.event != "heartbeat":
                        retry_seq = int(sse.id)
                break
        # The failed POST's turn row held the task (the 409s) until the
        # stale-turn sweep removed it (or, wrongly, ran it). Once no turn of the
        # task is queued or running, nothing is left that could run the message
        # again; and the archive, read below, holds the log to its end.
        await until(
            lambda: _settled(database_url, found[1], retry_seq),
            "a turn of the task still queued or running, or its log not archived",
            within=60,
        )

    turns = await pg_rows(database_url, "SELECT id, status FROM turns WHERE task_id = %s", found[1])
    events = await pg_rows(
        database_url, "SELECT DISTINCT turn_id FROM events WHERE task_id = %s", found[1]
    )
    effects = workspace(Path(cluster.env["HOLDFAST_WORKSPACE_ROOT"]), found) / "effects.log"
    ran = (await asyncio.to_thread(effects.read_text)).count("ran")
    assert ran == 1, f"the message's tool ran {ran} times; turns {turns}, logged {events}"
    # The first turn and the message sent again: the failed POST left nothing.
    assert len(events) == 2, f"turns with events: {events} (turn rows: {turns})"


async def _settled(database_url: str, task_id: str, last_seq: int) -> bool:
    unfinished = await pg_rows(
        database_url,
        "SELECT count(*) FROM turns WHERE task_id = %s AND status IN ('queued', 'running')",
        task_id,
    )
    archived = await pg_rows(
        database_url, "SELECT coalesce(max(seq), 0) FROM events WHERE task_id = %s", task_id
    )
    return bool(unfinished[0][0] == 0 and archived[0][0] >= last_seq)
