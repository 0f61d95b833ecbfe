"""Raw baseline: redis-py asyncio XADD → blocking XREAD on the same Redis.

Same client settings as the engine (``holdfast_shared.redisconn.connect``:
hiredis parser when installed, ``decode_responses=True``), and entries shaped
like the engine's (fields ``t``, ``ts``, ``d`` with a ~150-byte JSON ``d``).
The producer awaits each XADD (one round trip per entry, no pipelining); the
consumer reads with ``COUNT 1000`` and ``BLOCK``. Rate = entries ÷ (time
from the first XADD until the consumer has seen the last entry).

The pipelined baseline (:func:`pipelined`) is the most Redis takes on this
machine: each producer sends its XADDs in pipelines of ``PIPELINE`` (one
round trip per 100 entries), the consumer reads the same way. Awaiting each
XADD flatters the engine, which batches its appends; the table gives its
rows against both.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from holdfast_shared.redisconn import connect

READ_COUNT = 1000
PIPELINE = 100


def sample_payload(seq: int) -> dict[str, str]:
    """Fields of one entry, the size and shape of a logged ``text_delta``."""
    ts = 1_763_000_000_000 + seq
    data = (
        '{"task_id":"task_019a9c1f2e3d4b5c6d7e8f9a0b1c","turn_id":"turn_019a9c1f2e3d4b5c6d7e8f'
        f'9a0b2d","seq":{seq},"timestamp":{ts},"type":"text_delta","text":"x"}}'
    )
    return {"t": "text_delta", "ts": str(ts), "d": data}


async def _consume(redis: Any, keys: list[str], total: int) -> float:
    cursors = dict.fromkeys(keys, "0-0")
    seen = 0
    while seen < total:
        response = await redis.xread(cursors, count=READ_COUNT, block=10_000)
        if not response:
            raise RuntimeError(f"raw baseline: consumer stalled at {seen}/{total}")
        for key, entries in response:
            seen += len(entries)
            cursors[key] = entries[-1][0]
    return time.perf_counter()


async def _produce(redis: Any, key: str, payloads: list[dict[str, str]]) -> None:
    xadd = redis.xadd
    for fields in payloads:
        await xadd(key, fields)


async def _produce_pipelined(redis: Any, key: str, payloads: list[dict[str, str]]) -> None:
    for i in range(0, len(payloads), PIPELINE):
        pipe = redis.pipeline(transaction=False)
        for fields in payloads[i : i + PIPELINE]:
            pipe.xadd(key, fields)
        await pipe.execute()


async def pipelined(redis_url: str, prefix: str, events: int, streams: int) -> float:
    """:func:`xadd_xread` with every producer's XADDs in pipelines of ``PIPELINE``."""
    return await xadd_xread(redis_url, prefix, events, streams, pipeline=True)


async def xadd_xread(
    redis_url: str, prefix: str, events: int, streams: int, *, pipeline: bool = False
) -> float:
    """Events/s with ``streams`` producers (one per stream) and one consumer of all."""
    produce = _produce_pipelined if pipeline else _produce
    redis = connect(redis_url, max_connections=streams + 10)
    keys = [f"{prefix}raw:{'p' if pipeline else ''}{streams}:{i}" for i in range(streams)]
    per_stream = [events // streams + (1 if i < events % streams else 0) for i in range(streams)]
    try:
        await redis.delete(*keys)
        await redis.ping()
        payloads = [[sample_payload(i) for i in range(1, n + 1)] for n in per_stream]
        consumer = asyncio.create_task(_consume(redis, keys, events))
        await asyncio.sleep(0.05)  # the consumer is blocked in XREAD before we start
        start = time.perf_counter()
        await asyncio.gather(*(produce(redis, k, p) for k, p in zip(keys, payloads, strict=True)))
        end = await consumer
        return events / (end - start)
    finally:
        await redis.delete(*keys)
        await redis.aclose()
