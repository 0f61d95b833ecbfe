"""``GET /execute/replay?follow=task``: one stream that follows a task across turns.

Without it a replay ends with the running turn, or at once when none runs, and
a view that keeps a task open (the web console) had to reopen it every few
seconds while the task was idle. ``follow=task`` stays open through every later
turn and ends after the stream-token TTL, so that a revoked key or a deleted
task stops being followed within that time.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator

import httpx
import pytest
from holdfast_gateway.fanout import Hub
from holdfast_gateway.sse import event_frames
from holdfast_shared.eventlog import EventLog
from holdfast_shared.events import TextDelta, ThreadLifecycle
from holdfast_shared.keys import Keys
from httpx_sse import aconnect_sse
from redis.asyncio import Redis

from tests.processes import EngineProcesses
from tests.sse_client import execute

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def hub(redis: Redis, eventlog: EventLog, redis_prefix: str) -> AsyncIterator[Hub]:
    # The eventlog fixture's keys: the hub tails the streams it writes.
    tailer = Hub(redis, Keys(f"{redis_prefix}eventlog:"), eventlog)
    running = asyncio.create_task(tailer.run())
    yield tailer
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)
    await tailer.close()


def seqs_of(chunk: str) -> list[int]:
    return [int(line[4:]) for line in chunk.split("\r\n") if line.startswith("id: ")]


async def test_a_task_follow_goes_on_through_later_turns_and_ends_at_its_bound(
    hub: Hub, eventlog: EventLog
) -> None:
    task = f"t-{secrets.token_hex(6)}"
    await eventlog.append(
        task,
        "turn_a",
        [ThreadLifecycle(phase="started"), ThreadLifecycle(phase="completed")],
        name=task,
        new_task=True,
    )
    bound = 2.0
    loop = asyncio.get_running_loop()
    opened = loop.time()
    frames = event_frames(hub, eventlog, task, 0, stop_turn=None, follow_for=bound)
    got = seqs_of(await anext(frames))
    assert got == [1, 2]
    # No turn runs, and the stream has not ended: the next turn comes through it.
    reading = asyncio.create_task(anext(frames))
    await eventlog.append(
        task,
        "turn_b",
        [
            ThreadLifecycle(phase="started"),
            TextDelta(text="hi"),
            ThreadLifecycle(phase="completed"),
        ],
        name=task,
    )
    while len(got) < 5:
        got += seqs_of(await asyncio.wait_for(reading, timeout=30))
        reading = asyncio.create_task(anext(frames))
    assert got == [1, 2, 3, 4, 5]
    # Past the end of turn_b too: it ends at its bound, and only then.
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(reading, timeout=bound + 30)
    assert loop.time() - opened >= bound


async def test_replay_with_follow_task_stays_open_for_the_next_turn(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"follow-{secrets.token_hex(3)}"
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(timeout=60) as client:
        first = await execute(client, engine.url, key, {"message": "one", "task_id": task_id})
        assert first.events[-1]["phase"] == "completed"
        params = {"task_id": task_id, "after_seq": "0", "follow": "task"}
        url = f"{engine.url}/execute/replay"
        seen: list[dict[str, object]] = []
        async with aconnect_sse(client, "GET", url, params=params, headers=headers) as source:
            assert source.response.status_code == 200
            events = source.aiter_sse()

            async def until_completed() -> None:
                async for sse in events:
                    if sse.event == "heartbeat":
                        continue
                    seen.append(json.loads(sse.data))
                    if seen[-1].get("phase") == "completed":
                        return
                raise AssertionError(f"the stream ended after {seen}")

            await asyncio.wait_for(until_completed(), timeout=30)
            assert [e["seq"] for e in seen] == first.seqs
            # An idle task: the stream is still open and carries the next turn.
            second = await execute(client, engine.url, key, {"message": "two", "task_id": task_id})
            seen.clear()
            await asyncio.wait_for(until_completed(), timeout=30)
            assert [e["seq"] for e in seen] == second.seqs
        bad = await client.get(url, params={**params, "follow": "forever"}, headers=headers)
    assert bad.status_code == 422 and bad.json()["error"] == "INVALID_REQUEST"
