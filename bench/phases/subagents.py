"""Subagents: delegation overhead (a parent's ``delegate`` call → its child's
``started``) p50 / p99, and the text_delta rate of a parent streaming 5
children at once against 5 independent tasks of the same script, same run.

Overhead: :data:`SAMPLES` parents, one after the other, each delegating one
child that answers at once; per sample, the child's ``started`` timestamp
minus the parent's ``tool_call`` one (both stamped by the event log's append
in Redis, one clock). It holds the parent's model step ending (its snapshot),
the child's rows, epoch and job, and its ``started``. Throughput: the
children's deltas as the parent's client receives them (mirrored), first to
last, against the deltas of 5 tasks run side by side, first to last; both
read by the same client code.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from httpx_sse import aconnect_sse

from bench.context import Context, run_async
from bench.scenarios import new_client, percentile, script
from bench.table import Row

SAMPLES = 30
CHILDREN = 5
TARGET_OVERHEAD_P50_MS = 20.0
TARGET_RATIO = 0.8


def delegating(children: list[tuple[str, str]]) -> str:
    calls = [{"name": "delegate", "input": {"agent": a, "brief": b}} for a, b in children]
    return script(tool_calls=calls)


async def _events(url: str, key: str, body: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """The turn's events, each with when the client received it (perf_counter)."""
    got: list[tuple[float, dict[str, Any]]] = []
    async with new_client() as client:
        headers = {"X-Engine-Key": key}
        target = f"{url}/execute"
        async with aconnect_sse(client, "POST", target, json=body, headers=headers) as sse:
            sse.response.raise_for_status()
            async for frame in sse.aiter_sse():
                if frame.event == "heartbeat":
                    continue
                event = json.loads(frame.data)
                got.append((time.perf_counter(), event))
    last = got[-1][1]
    if last.get("phase") != "completed":
        raise RuntimeError(f"turn of {last.get('task_id')} ended {last}")
    return got


async def _child_started(url: str, key: str, child: str) -> int:
    async with new_client() as client:
        params = {"task_id": child, "after_seq": 0}
        headers = {"X-Engine-Key": key}
        async with aconnect_sse(
            client, "GET", f"{url}/execute/replay", params=params, headers=headers
        ) as sse:
            async for frame in sse.aiter_sse():
                event = json.loads(frame.data)
                if event["type"] == "thread_lifecycle" and event["phase"] == "started":
                    return int(event["timestamp"])
    raise RuntimeError(f"{child} logged no started")


async def overheads(url: str, key: str, samples: int) -> list[float]:
    found = []
    message = delegating([("writer", script(text="ok"))])
    for _ in range(samples):
        body = {"message": message, "task_id": f"bench-delegate-{secrets.token_hex(4)}"}
        events = [e for _, e in await _events(url, key, body)]
        call = next(e for e in events if e["type"] == "tool_call")
        child = next(e for e in events if e["type"] == "subagent_started")["subagent"]["task_id"]
        found.append(float(await _child_started(url, key, child) - call["timestamp"]))
    return found


def _rate(stamped: list[float]) -> float:
    return len(stamped) / max(stamped[-1] - stamped[0], 1e-9)


async def parent_rate(url: str, key: str, deltas: int) -> float:
    """Deltas/s of the children, as the parent's client receives them."""
    brief = script(text="x", deltas=deltas)
    body = {"message": delegating([("writer", brief)] * CHILDREN)}
    got = await _events(url, key, body)
    times = [t for t, e in got if e["type"] == "text_delta" and e.get("subagent")]
    if len(times) != CHILDREN * deltas:
        raise RuntimeError(f"{len(times)} of {CHILDREN * deltas} child deltas reached the parent")
    return _rate(times)


async def independent_rate(url: str, key: str, deltas: int) -> float:
    """Deltas/s of 5 tasks of the same script side by side, first to last."""
    body = {"message": script(text="x", deltas=deltas)}
    runs = await asyncio.gather(*(_events(url, key, dict(body)) for _ in range(CHILDREN)))
    times = sorted(t for got in runs for t, e in got if e["type"] == "text_delta")
    return _rate(times)


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    ctx.set_workers(1, ctx.workers_for(1))
    ctx.pause("subagents")
    url, key = ctx.engine.gateway_url, ctx.engine.api_key
    label = "Delegation overhead (delegate call → child started)"
    ctx.say(f"{label}: {SAMPLES} delegations")
    found: list[float] | None = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, _pg):
        found = run_async(lambda: overheads(url, key, SAMPLES), ctx.use_uvloop)
    if found:
        p50 = percentile(found, 50)
        rows.append(
            Row(
                f"{label} p50 / p99",
                f"{p50:.0f} ms / {percentile(found, 99):.0f} ms",
                target=f"p50 ≤ {TARGET_OVERHEAD_P50_MS:.0f} ms",
                detail=f"{len(found)} parents, one child each; child started - parent "
                f"tool_call (event log timestamps). CPU: {cpu.summary()}",
                ok=p50 <= TARGET_OVERHEAD_P50_MS,
            )
        )
    deltas = ctx.sizes.task_deltas
    label = f"A parent streaming {CHILDREN} children / {CHILDREN} independent tasks"
    ctx.say(f"{label}: {deltas} deltas each")
    rates: tuple[float, float] | None = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, _pg):
        alone = run_async(lambda: independent_rate(url, key, deltas), ctx.use_uvloop)
        mirrored = run_async(lambda: parent_rate(url, key, deltas), ctx.use_uvloop)
        rates = mirrored, alone
    if rates is None:
        return rows
    mirrored, alone = rates
    ratio = mirrored / alone
    rows.append(
        Row(
            label,
            f"{mirrored:,.0f}/s",
            base=f"{alone:,.0f}/s",
            ratio=f"{ratio:.2f}",
            target=f"≥ {TARGET_RATIO}",
            detail=f"deltas/s received: the children's through the parent's stream, "
            f"against 5 tasks side by side; {CHILDREN} x {deltas} deltas, one loop-worker "
            f"(every child delta is logged twice: its task, then the parent's). "
            f"CPU: {cpu.summary()}",
            ok=ratio >= TARGET_RATIO,
        )
    )
    return rows
