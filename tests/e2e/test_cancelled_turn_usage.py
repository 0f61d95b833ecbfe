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
from httpx_sse import aconnect_sse

from tests.processes import EngineProcesses

pytestmark = [pytest.mark.timeout(120)]


async def test_a_cancelled_turn_counts_the_tokens_it_streamed(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    task_id = f"cancel-usage-{secrets.token_hex(3)}"
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
        detail = (await client.get(f"{engine.url}/tasks/{task_id}", headers=headers)).json()
    assert events[-1]["phase"] == "completed" and events[-1]["stop_reason"] == "cancelled"
    streamed = [e for e in events if e["type"] == "text_delta"]
    assert 50 <= len(streamed) < 400
    usage = [e for e in events if e["type"] == "usage"][-1]
    assert usage["input_tokens"] > 0, usage
    # At least what the client was shown ("word " is two tokens at most, by any count).
    assert usage["output_tokens"] >= len(streamed), usage
    totals = detail["usage"]
    assert totals["input_tokens"] == usage["input_tokens"], detail
    assert totals["output_tokens"] == usage["output_tokens"], detail
