"""A loop-worker that stalls past its lease (SIGSTOP, then SIGCONT) while another takes over.

A stall longer than ``HOLDFAST_LEASE_SECONDS`` — a stopped container, a
starved CPU, a long GC pause — looks like a death to the other workers: one
of them claims the turn and resumes it. When the stalled worker wakes up it
must not go on writing to that turn: the turn still has exactly one
``started`` and one terminal event, and its visible text once.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from tests.chaos.cluster import ChaosCluster, chaos_env, running_cluster
from tests.chaos.invariants import lease_owner, visible_text
from tests.waiting import logged_after, until, until_log_line, until_logged

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture
async def cluster(database_url: str, tmp_path: Path) -> AsyncIterator[ChaosCluster]:
    env = chaos_env(database_url, tmp_path / "workspaces")
    async with running_cluster(tmp_path, env, gateways=1, workers=2, runners=0) as c:
        yield c


def ended(events: list[dict[str, Any]]) -> bool:
    return any(
        e["type"] == "thread_lifecycle" and e["phase"] in ("completed", "errored") for e in events
    )


async def test_a_stalled_worker_does_not_write_to_a_turn_taken_over(
    cluster: ChaosCluster, api_keys: dict[str, str], database_url: str
) -> None:
    key = api_keys["main"]
    url = cluster.gateway_urls()[0]
    task_id = f"stalled-{time.time_ns()}"
    message = "/script " + json.dumps({"text": "p ", "deltas": 60, "delay_ms": 50})
    async with httpx.AsyncClient(timeout=60) as http:
        async with aconnect_sse(
            http,
            "POST",
            f"{url}/execute",
            json={"message": message, "task_id": task_id},
            headers={"X-Engine-Key": key},
        ) as source:
            turn_id = source.response.headers["x-turn-id"]
            seen = 0
            async for sse in source.aiter_sse():
                seen += sse.event == "text_delta"
                if seen == 10:
                    break
        stalled_lease = await lease_owner(database_url, turn_id)
        owner = cluster.owner(stalled_lease or "")
        assert owner is not None
        owner.popen.send_signal(signal.SIGSTOP)
        try:
            # Past the lease the other worker claims the turn and runs the
            # model call again (60 deltas x 50 ms = 3 s); the stalled one
            # wakes up in the middle of that. The takeover comes within about
            # 4 leases (the lease, twice the lease of staleness, one sweep);
            # a loaded CI machine adds seconds to that, so wait for it generously.
            async def taken_over() -> bool:
                return await lease_owner(database_url, turn_id) not in (None, stalled_lease)

            await until(taken_over, "no other worker took the turn over", within=30)
            # Wake it up while the other worker streams the model call again.
            await until_logged(
                http,
                url,
                key,
                task_id,
                logged_after("turn_resumed", "text_delta"),
                "the worker that took over never streamed",
            )
        finally:
            owner.popen.send_signal(signal.SIGCONT)
        # Woken up, the stalled worker tried to go on and was refused.
        await until_log_line(
            owner.log,
            f"turn {turn_id} was taken over by another worker; stopping",
            "the stalled worker never noticed it lost the turn",
        )
        events = await until_logged(
            http, url, key, task_id, ended, "the turn never ended", within=60
        )
    mine = [e for e in events if e["turn_id"] == turn_id]
    lifecycle = [(e["seq"], e["phase"]) for e in mine if e["type"] == "thread_lifecycle"]
    assert len(lifecycle) == 2, f"one started and one terminal event, got {lifecycle}"
    assert visible_text(mine) == "p " * 60
