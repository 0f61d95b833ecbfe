"""Reading a chaos run's results: every task's final log, and what its processes logged."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from holdfast_shared.redisconn import connect
from httpx_sse import aconnect_sse

from tests.chaos.cluster import ChaosCluster


async def read_log(http: httpx.AsyncClient, url: str, key: str, task_id: str) -> list[str]:
    """The task's whole log as raw JSON, through a gateway (replay from 0).

    A turn still running is followed for 20 s at most: then what came is kept.
    """
    out: list[str] = []
    with contextlib.suppress(TimeoutError):
        async with (
            asyncio.timeout(20),
            aconnect_sse(
                http,
                "GET",
                f"{url}/execute/replay",
                params={"task_id": task_id, "after": 0},
                headers={"X-Engine-Key": key},
            ) as source,
        ):
            if source.response.status_code != 200:
                return out
            async for sse in source.aiter_sse():
                if sse.event != "heartbeat":
                    out.append(sse.data)
    return out


async def final_logs(
    http: httpx.AsyncClient,
    cluster: ChaosCluster,
    key: str,
    ids: list[str],
    *,
    redis_cluster_url: str | None = None,
) -> dict[str, list[str]]:
    """Every task's log once the archiver caught up (bounded retries per task).

    ``redis_cluster_url``: the engine runs on a Redis Cluster (the backlog is
    read there); else on ``cluster.redis``.
    """
    if redis_cluster_url is not None:
        redis = connect(redis_cluster_url, cluster=True)
    else:
        redis = connect(cluster.redis.url, cluster=False)
    try:
        for _ in range(200):
            if not await redis.zcard(f"{cluster.env['HOLDFAST_REDIS_PREFIX']}archive:dirty"):
                break
            await asyncio.sleep(0.1)
    finally:
        await redis.aclose()
    logs: dict[str, list[str]] = {}
    for task_id in ids:
        logs[task_id] = []
        for _ in range(5):
            try:
                logs[task_id] = await read_log(http, cluster.pick_gateway() or "", key, task_id)
                break
            except httpx.HTTPError:
                await asyncio.sleep(0.5)
    return logs


def superseded_writers(cluster: ChaosCluster) -> int:
    """How often a worker woke up to find its turn taken over, and stopped (its logs)."""
    line = "was taken over by another worker; stopping"
    return sum(log.read_text(errors="replace").count(line) for log in cluster.log_dir.glob("*.log"))
