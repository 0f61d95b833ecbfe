"""A cancelled turn reports what its cut-off model call cost (#25, item 5).

Providers report a call's usage once, at the end of its stream; a cancel cuts
the stream before that, and the turn's last ``usage`` read 0/0 after the
client had seen 50 deltas (its row's totals too). Real engine, scripted model.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any

import httpx
import pytest
from holdfast_gateway import taskstatus
from holdfast_shared.db.models import Turn
from holdfast_shared.eventlog import EventLog
from holdfast_shared.keys import Keys
from httpx_sse import aconnect_sse
from redis.asyncio import Redis
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.processes import EngineProcesses

pytestmark = [pytest.mark.timeout(120)]


async def cancel_after_50_deltas(
    engine: EngineProcesses, key: str, task_id: str
) -> list[dict[str, Any]]:
    """A 400-delta scripted turn, cancelled once the client has seen 50; its events."""
    headers = {"X-Engine-Key": key}
    message = "/script " + json.dumps({"text": "word ", "deltas": 400, "delay_ms": 20})
    events: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=60) as client:
        body = {"message": message, "task_id": task_id}
        url = f"{engine.url}/execute"
        async with aconnect_sse(client, "POST", url, json=body, headers=headers) as source:
            assert source.response.status_code == 200

            async def read() -> None:
                deltas = 0
                cancelled = False
                async for sse in source.aiter_sse():
                    if sse.event == "heartbeat":
                        continue
                    events.append(json.loads(sse.data))
                    deltas += sse.event == "text_delta"
                    if deltas >= 50 and not cancelled:
                        cancelled = True
                        answer = await client.post(
                            f"{engine.url}/execute/cancel",
                            json={"task_id": task_id},
                            headers=headers,
                        )
                        assert answer.status_code == 200, answer.text

            await asyncio.wait_for(read(), timeout=60)
    return events


async def task_usage(engine: EngineProcesses, key: str, task_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as client:
        got = await client.get(f"{engine.url}/tasks/{task_id}", headers={"X-Engine-Key": key})
    assert got.status_code == 200, got.text
    usage: dict[str, Any] = got.json()["usage"]
    return usage


async def test_a_cancelled_turn_counts_the_tokens_it_streamed(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"cancel-usage-{secrets.token_hex(3)}"
    events = await cancel_after_50_deltas(engine, key, task_id)
    totals = await task_usage(engine, key, task_id)
    assert events[-1]["phase"] == "completed" and events[-1]["stop_reason"] == "cancelled"
    streamed = [e for e in events if e["type"] == "text_delta"]
    assert 50 <= len(streamed) < 400
    usage = [e for e in events if e["type"] == "usage"][-1]
    assert usage["input_tokens"] > 0, usage
    # At least what the client was shown ("word " is two tokens at most, by any count).
    assert usage["output_tokens"] >= len(streamed), usage
    assert totals["input_tokens"] == usage["input_tokens"], totals
    assert totals["output_tokens"] == usage["output_tokens"], totals


async def test_a_turn_ended_in_the_log_but_not_on_its_row_counts_its_logged_usage(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    redis_prefix: str,
) -> None:
    """A turn logs its end, then records its totals on its row. A read between
    the two (a client reading the task the moment its stream ends, as the test
    above does) once fell back to the turn's last snapshot, which predates the
    call the cancel cut off: 0 input tokens. The window is recreated inside a
    transaction that is rolled back (so no sweep or queued job of the engine
    ever sees the row put back), and read the way ``GET /tasks/{id}`` reads."""
    key = api_keys["main"]
    task_id = f"cancel-window-{secrets.token_hex(3)}"
    events = await cancel_after_50_deltas(engine, key, task_id)
    usage = [e for e in events if e["type"] == "usage"][-1]
    turn_id = events[-1]["turn_id"]
    log = EventLog(redis, sessions, Keys(redis_prefix), hot_ttl_seconds=10800)
    async with sessions() as session:
        for _ in range(400):  # the row records the end just after the stream ends
            row = await session.get(Turn, turn_id, populate_existing=True)
            if row is not None and row.usage is not None:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"turn {turn_id} never recorded its end")
        task = row.task_id
        await session.execute(
            update(Turn)
            .where(Turn.id == turn_id)
            .values(status="running", usage=None, active_ms=None, finished_at=None)
        )
        last = await taskstatus.last_event(log, session, task)
        ended = await taskstatus.ended_turn(log, task, last)
        detail = await taskstatus.task_detail(session, task, ended)
        await session.rollback()
    assert detail is not None
    totals = detail.usage
    assert totals["input_tokens"] == usage["input_tokens"] > 0, totals
    assert totals["output_tokens"] == usage["output_tokens"] > 0, totals
    assert totals["active_seconds"] == pytest.approx(usage["active_seconds"], abs=0.001)
