"""Structured results survive a SIGKILL (#27): the worker running a turn is killed
while the model gives its corrected answer; another worker takes the turn over,
asks again from the snapshot (the first answer, its correction), and the turn
ends with one ``result`` — the correction sent once, the answer counted twice,
not three times."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Message, Turn
from httpx_sse import aconnect_sse
from sqlalchemy import select

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "why": {"type": "string"}},
    "required": ["answer"],
}
# Forty words, 50 ms apart: each answer streams for about two seconds.
WHY = " ".join(f"w{n}" for n in range(40))


@pytest.fixture(scope="module")
def two_workers(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    prefix = f"{redis_prefix}structured-takeover-{secrets.token_hex(3)}:"
    env = engine_env(redis_url, database_url, prefix)
    directory = tmp_path_factory.mktemp("structured-takeover")
    with running_engine(env, workers=2, directory=directory) as procs:
        yield procs


async def test_a_worker_killed_mid_correction_leaves_one_result(
    two_workers: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    procs = two_workers
    script = {
        "results": [{"answer": "four", "why": WHY}, {"answer": 4, "why": WHY}],
        "delay_ms": 50,
    }
    body = {"message": "/script " + json.dumps(script), "output_schema": ANSWER}
    events: list[dict[str, Any]] = []

    async def read(client: httpx.AsyncClient) -> None:
        headers = {"X-Engine-Key": api_keys["main"]}
        url = f"{procs.url}/execute"
        async with aconnect_sse(client, "POST", url, headers=headers, json=body) as source:
            async for sse in source.aiter_sse():
                if sse.event != "heartbeat":
                    events.append(json.loads(sse.data))

    async with httpx.AsyncClient(timeout=90) as client:
        reading = asyncio.create_task(read(client))

        async def second_answer_streams() -> bool:
            starts = [i for i, e in enumerate(events) if e["type"] == "content_block_start"]
            return len(starts) == 2 and len(events) - starts[1] > 5

        await until(second_answer_streams, "the corrected answer streaming")
        turn_id = events[0]["turn_id"]
        async with sessions() as session:
            owner = await session.scalar(select(Turn.lease_owner).where(Turn.id == turn_id))
        victim = next(p for p in procs.workers if p.ident == owner)
        await asyncio.to_thread(procs.kill, victim, signal.SIGKILL)
        await asyncio.wait_for(reading, 60)

    kinds = [e["type"] for e in events]
    assert "turn_resumed" in kinds, kinds
    assert kinds[-1] == "thread_lifecycle" and events[-1]["phase"] == "completed"
    [result] = [e for e in events if e["type"] == "result"]
    assert result["result"] == {"answer": 4, "why": WHY}
    assert result["attempts"] == 2
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap or a repeat"

    async def recorded() -> bool:
        async with sessions() as session:
            stored = await session.scalar(select(Turn.result).where(Turn.id == turn_id))
        return bool(stored == {"answer": 4, "why": WHY})

    await until(recorded, "the result on the turn's row")
    async with sessions() as session:
        rows = (
            await session.execute(
                select(Message.role, Message.content)
                .where(Message.turn_id == turn_id)
                .order_by(Message.position)
            )
        ).all()
    # The first answer, its correction once, the corrected answer once.
    assert [role for role, _ in rows] == ["user", "assistant", "user", "assistant"]
    assert "not of type 'integer'" in rows[2][1]["blocks"][0]["text"]
