"""A worker killed during the model call that follows a tool result.

Found by the chaos run's text check, pinned down here deterministically: the
model call after the tool results is made to stream for a while (the tool
prints ~10,000 words, which the scripted model echoes word by word), and the
worker running the turn is SIGKILLed once that call's first text delta is
out. The turn must go on elsewhere and a client that drops the ranges
``turn_resumed`` names must show the answer exactly once.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from tests.chaos.cluster import ChaosCluster, chaos_env, running_cluster
from tests.chaos.invariants import lease_owner, visible_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
async def cluster(database_url: str, tmp_path: Path) -> AsyncIterator[ChaosCluster]:
    # The tool's long output goes back to the model whole: the echo is compared below.
    env = chaos_env(
        database_url, tmp_path / "workspaces", HOLDFAST_TOOL_RESULT_CONTEXT_CHARS="1000000"
    )
    async with running_cluster(tmp_path, env, gateways=1, workers=2, runners=1) as c:
        yield c


async def test_kill_during_the_answer_to_tool_results(
    cluster: ChaosCluster, api_keys: dict[str, str], database_url: str
) -> None:
    key = api_keys["main"]
    script = {
        "text": "a ",
        "deltas": 3,
        "tool_calls": [{"name": "bash", "input": {"command": "echo $(seq 1 10000)"}}],
    }
    body = {"message": "/script " + json.dumps(script), "task_id": f"after-tools-{time.time_ns()}"}
    events: list[dict[str, Any]] = []
    killed = None
    async with httpx.AsyncClient(timeout=60) as http:
        async with aconnect_sse(
            http,
            "POST",
            f"{cluster.gateway_urls()[0]}/execute",
            json=body,
            headers={"X-Engine-Key": key},
        ) as source:
            async for sse in source.aiter_sse():
                if sse.event == "heartbeat":
                    continue
                event = json.loads(sse.data)
                events.append(event)
                after_result = any(e["type"] == "tool_result" for e in events)
                if killed is None and after_result and event["type"] == "text_delta":
                    owner = await lease_owner(database_url, event["turn_id"])
                    victim = cluster.owner(owner or "")
                    assert victim is not None, f"no worker holds the turn ({owner})"
                    await cluster.kill(victim)
                    killed = event["seq"]  # the other worker takes the turn over
    assert killed is not None, "the answer to the tool results was never streamed"
    assert events[-1]["type"] == "thread_lifecycle" and events[-1]["phase"] == "completed"
    resumed = [e for e in events if e["type"] == "turn_resumed"]
    assert resumed, "the turn was not resumed on another worker"
    result = next(e for e in events if e["type"] == "tool_result")
    summary = [{k: result[k] for k in ("output", "error") if result.get(k) is not None}]
    text = visible_text(events)
    prefix = "a a a Tool results: "
    assert text.startswith(prefix), text[:100]
    # Before the fix the partial answer stays visible and the full one follows it.
    cut_off = [
        e["seq"]
        for e in events
        if e["type"] == "text_delta" and result["seq"] < e["seq"] < resumed[0]["seq"]
    ]
    assert resumed[0].get("discard_from_seq") is not None, (
        f"turn_resumed {resumed[0]} names no range, yet {len(cut_off)} text deltas "
        f"({cut_off[0]}..{cut_off[-1]}) of the cut-off answer precede it"
    )
    assert json.loads(text[len(prefix) :]) == summary
