"""Schedules: firing jitter, a due time → its turn written, p50/p99.

A schedule due every second (a new task per run, overlap ``skip``, each
run's scripted turn answering at once) runs for :data:`SAMPLES` due times;
each started run's jitter is its ``fired_at`` (the scheduler's clock when it
wrote the run's turn, in the turn's transaction) minus its ``due_at``, as
``GET /schedules/{name}/runs`` reports them. The scheduler sleeps until the
next due time, so the figure is the timer's lateness plus one round's
PostgreSQL work. The schedule is deleted after.
"""

from __future__ import annotations

import asyncio
import secrets
from datetime import datetime

from bench.context import Context, run_async
from bench.scenarios import new_client, percentile, script
from bench.table import Row

TARGET_P99_MS = 1000.0
SAMPLES = 30


async def jitters(url: str, key: str, samples: int) -> tuple[list[float], int]:
    """Milliseconds from each started run's due time to its turn; and the runs skipped."""
    headers = {"X-Engine-Key": key}
    name = f"bench-jitter-{secrets.token_hex(4)}"
    async with new_client() as client:
        created = await client.post(
            f"{url}/schedules",
            json={"name": name, "interval_seconds": 1, "message": script(text="ok")},
            headers=headers,
        )
        created.raise_for_status()
        try:
            while True:
                got = await client.get(f"{url}/schedules/{name}/runs?limit=1000", headers=headers)
                got.raise_for_status()
                runs = got.json()["runs"]
                if len(runs) >= samples:
                    break
                await asyncio.sleep(0.5)
        finally:
            deleted = await client.delete(f"{url}/schedules/{name}", headers=headers)
            deleted.raise_for_status()
    found = [
        (_instant(r["fired_at"]) - _instant(r["due_at"])).total_seconds() * 1000
        for r in runs
        if r["status"] == "started"
    ]
    return found, sum(1 for r in runs if r["status"] != "started")


def _instant(value: str) -> datetime:
    return datetime.fromisoformat(value)


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    ctx.set_workers(1, ctx.workers_for(1))
    ctx.pause("schedules")
    label = "Schedule firing jitter (due → turn written)"
    ctx.say(f"{label}: {SAMPLES} due times, 1 s apart")
    found: tuple[list[float], int] | None = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, _pg):
        found = run_async(
            lambda: jitters(ctx.engine.gateway_url, ctx.engine.api_key, SAMPLES),
            ctx.use_uvloop,
        )
    if not found or not found[0]:
        return rows
    values, skipped = found
    p99 = percentile(values, 99)
    rows.append(
        Row(
            f"{label} p50 / p99",
            f"{percentile(values, 50):.0f} ms / {p99:.0f} ms",
            target=f"p99 ≤ {TARGET_P99_MS:.0f} ms",
            detail=f"{len(values)} runs of a 1 s interval schedule ({skipped} skipped), "
            f"max {max(values):.0f} ms; fired_at - due_at. CPU: {cpu.summary()}",
            ok=p99 <= TARGET_P99_MS,
        )
    )
    return rows
