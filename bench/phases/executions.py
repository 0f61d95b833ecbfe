"""Executions: ``POST /v1/execution/{id}/pause`` → ``paused`` p50/p99 while the
execution's model streams.

Each sample creates an execution whose scripted model streams for about ten
seconds, waits for its first ``text_delta`` on ``GET /execute/replay``, then
times from sending the pause to the first ``GET /v1/execution/{id}`` that
answers ``paused`` (polled every 10 ms, so the figure is up to 10 ms high).
The worker cuts the streaming model call short on the pause (it is not
waited out), parks the turn (snapshot, lease released, no worker held) and
marks the row. Each execution is deleted after its sample.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench.context import Context, run_async
from bench.scenarios import new_client, percentile, script
from bench.table import Row

TARGET_P50_MS = 500.0
SAMPLES = 20
# ~10 s of streaming: far longer than a pause may take.
_STREAMING = script(text="word ", deltas=2000, delay_ms=5)


async def _first_delta(client: httpx.AsyncClient, url: str, key: str, task_id: str) -> None:
    async with client.stream(
        "GET",
        f"{url}/execute/replay",
        params={"task_id": task_id, "after_seq": 0},
        headers={"X-Engine-Key": key},
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:") and json.loads(line[5:]).get("type") == "text_delta":
                return
    raise RuntimeError(f"execution {task_id} never streamed")


async def pause_latencies(url: str, key: str, samples: int) -> list[float]:
    """Milliseconds from sending the pause to reading ``paused``, one per sample."""
    headers = {"X-Engine-Key": key}
    found: list[float] = []
    async with new_client() as client:
        for _ in range(samples):
            created = await client.post(
                f"{url}/v1/execution",
                json={"name": "bench pause", "input": _STREAMING},
                headers=headers,
            )
            created.raise_for_status()
            execution_id = created.json()["id"]
            await _first_delta(client, url, key, execution_id)
            started = time.perf_counter()
            paused = await client.post(f"{url}/v1/execution/{execution_id}/pause", headers=headers)
            paused.raise_for_status()
            while True:
                got = await client.get(f"{url}/v1/execution/{execution_id}", headers=headers)
                got.raise_for_status()
                if got.json()["status"] == "paused":
                    break
                if time.perf_counter() - started > 30:
                    raise RuntimeError(f"execution {execution_id} did not pause in 30 s")
                await asyncio.sleep(0.01)
            found.append((time.perf_counter() - started) * 1000)
            deleted = await client.delete(f"{url}/v1/execution/{execution_id}", headers=headers)
            deleted.raise_for_status()
    return found


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    ctx.set_workers(1, ctx.workers_for(1))
    ctx.pause("executions")
    label = "pause → paused (model streaming)"
    ctx.say(f"{label}: {SAMPLES} executions")
    latencies: list[float] | None = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, _pg):
        latencies = run_async(
            lambda: pause_latencies(ctx.engine.gateway_url, ctx.engine.api_key, SAMPLES),
            ctx.use_uvloop,
        )
    if not latencies:
        return rows
    p50 = percentile(latencies, 50)
    rows.append(
        Row(
            f"{label} p50",
            f"{p50:.0f} ms",
            target=f"≤ {TARGET_P50_MS:.0f} ms",
            detail=f"{SAMPLES} executions, each paused after its first text_delta; "
            "POST pause sent → GET answers paused (polled every 10 ms)",
            ok=p50 <= TARGET_P50_MS,
        )
    )
    rows.append(
        Row(
            f"{label} p99",
            f"{percentile(latencies, 99):.0f} ms",
            detail=f"max {max(latencies):.0f} ms. CPU: {cpu.summary()}",
            ok=None,
        )
    )
    return rows
