"""Python SDK overhead: events/s through ``holdfast_client.Client`` (typed events, the
resume cursor, the transcript) against a bare httpx-sse reader on the same turn.

Two pairs of rows. Replay: both read the same stored turn from the log
(``GET /execute/replay``), best of three each, so the engine is not the limit
and the ratio is the SDK's own cost. Live: each streams a fresh, identical
scripted turn (``POST /execute``) as the worker produces it. The bare reader
only iterates httpx-sse's frames and counts the non-heartbeat ones; the SDK
parses each into its pydantic model, checks its seq and feeds the transcript.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
from holdfast_client import Client
from httpx_sse import EventSource

from bench.context import Context
from bench.table import Row

TARGET_RATIO = 0.8
REPEATS = 3


def _script(deltas: int) -> str:
    return "/script " + json.dumps({"text": "tok ", "deltas": deltas})


def _bare(response: httpx.Response) -> int:
    count = 0
    for sse in EventSource(response).iter_sse():
        if sse.event != "heartbeat":
            count += 1
    return count


def _bare_replay(url: str, key: str, task_id: str) -> tuple[int, float]:
    with httpx.Client(base_url=url, headers={"X-Engine-Key": key}, timeout=60) as http:
        start = time.perf_counter()
        with http.stream("GET", "/execute/replay", params={"task_id": task_id}) as response:
            response.raise_for_status()
            count = _bare(response)
        return count, time.perf_counter() - start


def _bare_live(url: str, key: str, deltas: int) -> tuple[int, float]:
    with httpx.Client(base_url=url, headers={"X-Engine-Key": key}, timeout=60) as http:
        start = time.perf_counter()
        body = {"message": _script(deltas)}
        with http.stream("POST", "/execute", json=body) as response:
            response.raise_for_status()
            count = _bare(response)
        return count, time.perf_counter() - start


def _sdk_replay(url: str, key: str, task_id: str) -> tuple[int, float]:
    with Client(url, key) as client:
        start = time.perf_counter()
        count = sum(1 for _ in client.replay(task_id))
        return count, time.perf_counter() - start


def _sdk_live(url: str, key: str, deltas: int) -> tuple[int, float]:
    with Client(url, key) as client:
        start = time.perf_counter()
        turn = client.stream(_script(deltas))
        count = sum(1 for _ in turn)
        elapsed = time.perf_counter() - start
        assert turn.transcript.text == "tok " * deltas, "the SDK's transcript is wrong"
        return count, elapsed


def _best(
    sdk: Callable[[], tuple[int, float]], bare: Callable[[], tuple[int, float]]
) -> tuple[int, float, float]:
    """Event count and best events/s of each reader, runs interleaved (bare first)
    so a busy moment of the machine does not fall on one side only."""
    runs: dict[str, list[tuple[int, float]]] = {"sdk": [], "bare": []}
    for _ in range(REPEATS):
        runs["bare"].append(bare())
        runs["sdk"].append(sdk())
    counts = {count for side in runs.values() for count, _ in side}
    assert len(counts) == 1, f"the readers saw different event counts: {counts}"
    sdk_rate, bare_rate = (max(n / elapsed for n, elapsed in runs[k]) for k in ("sdk", "bare"))
    return counts.pop(), sdk_rate, bare_rate


def run(ctx: Context) -> list[Row]:
    deltas = ctx.sizes.single_deltas
    url, key = ctx.engine.gateway_url, ctx.engine.api_key
    ctx.set_workers(1, ctx.workers_for(1))
    ctx.pause("sdk")
    rows: list[Row] = []
    label = f"SDK Client.stream, live turn of {deltas:,} deltas"
    ctx.say(label)
    with ctx.errors_to(rows, label):
        _, sdk_rate, bare_rate = _best(
            lambda: _sdk_live(url, key, deltas), lambda: _bare_live(url, key, deltas)
        )
        rows.append(_row(label, sdk_rate, bare_rate, f"best of {REPEATS} fresh turns each"))
    label = f"SDK Client.replay, stored turn of {deltas:,} deltas"
    ctx.say(label)
    with ctx.errors_to(rows, label):
        with Client(url, key) as client:
            turn = client.stream(_script(deltas))
            turn.until_done()
        task_id = turn.task_id
        assert task_id is not None
        _, sdk_rate, bare_rate = _best(
            lambda: _sdk_replay(url, key, task_id), lambda: _bare_replay(url, key, task_id)
        )
        rows.append(_row(label, sdk_rate, bare_rate, f"best of {REPEATS}, from the log"))
    return rows


def _row(label: str, sdk: float, bare: float, how: str) -> Row:
    ratio = sdk / bare
    return Row(
        label,
        f"{sdk:,.0f} events/s",
        f"{bare:,.0f} bare",
        f"{ratio:.2f}x",
        f"≥ {TARGET_RATIO}x bare httpx-sse",
        f"{how}; the bare reader iterates httpx-sse frames and counts them, the SDK "
        "yields typed events with its cursor and transcript",
        ok=ratio >= TARGET_RATIO,
    )
