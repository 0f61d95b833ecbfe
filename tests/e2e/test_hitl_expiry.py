"""A question nobody answers: past ``HOLDFAST_CHANNEL_STATE_TTL_HITL`` the asked-for
call fails with "expired" and the turn goes on, once; it is never asked again."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from holdfast.testing import scaled
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import replay

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TTL_SECONDS = 3


@pytest.fixture(scope="module")
def expiring_engine(
    redis_url: str,
    database_url: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_url,
        database_url,
        f"expiry{secrets.token_hex(2)}:",
        HOLDFAST_CHANNEL_STATE_TTL_HITL=str(TTL_SECONDS),
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("expiry")) as procs:
        yield procs


async def _until_ended(
    client: httpx.AsyncClient, url: str, key: str, task_id: str
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + scaled(90)
    while True:
        got = await replay(client, url, key, {"task_id": task_id, "after_seq": 0})
        ends = [e for e in got.events if e["type"] == "thread_lifecycle"]
        if ends and ends[-1]["phase"] in ("completed", "errored", "cancelled"):
            return got.events
        assert time.monotonic() < deadline, f"the turn never ended: {got.types}"
        await asyncio.sleep(0.5)


async def test_an_unanswered_question_expires_once_and_the_turn_goes_on(
    expiring_engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    url = expiring_engine.url
    task_id = f"expiry-{secrets.token_hex(3)}"
    ask = "/script " + json.dumps(
        {"tool_calls": [{"name": "ask_user", "input": {"question": "Which one?"}}]}
    )
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream(
            "POST",
            f"{url}/execute",
            json={"message": ask, "task_id": task_id},
            headers={"X-Engine-Key": key},
        ) as response:
            assert response.status_code == 200
        events = await _until_ended(client, url, key, task_id)

    types = [e["type"] for e in events]
    assert types.count("hitl_request") == 1, types
    call = next(e for e in events if e["type"] == "tool_call")
    result = next(
        e
        for e in events
        if e["type"] == "tool_result" and e["tool_call_id"] == call["tool_call_id"]
    )
    assert "expired" in json.dumps(result).lower(), result
    assert events[-1]["type"] == "thread_lifecycle" and events[-1]["phase"] == "completed"
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
