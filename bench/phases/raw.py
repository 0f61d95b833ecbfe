"""redis-py XADD→XREAD on this Redis, 1 and N streams, XADDs awaited or pipelined: the baselines.

Runs first, before any engine process starts. See ``bench.raw``.
"""

from __future__ import annotations

from bench import raw
from bench.context import Context, run_async
from bench.table import Row, fmt_rate


def run(ctx: Context) -> list[Row]:
    s, engine = ctx.sizes, ctx.engine
    rows: list[Row] = []
    ctx.say(f"raw baseline: {s.raw_events:,} entries, 1 stream")
    ctx.raw1 = run_async(
        lambda: raw.xadd_xread(engine.redis_url, engine.prefix, s.raw_events, 1),
        ctx.use_uvloop,
    )
    rows.append(
        Row(
            "raw redis-py XADD→XREAD, 1 stream",
            fmt_rate(ctx.raw1),
            detail=f"{s.raw_events:,} entries of ~150 B; 1 producer awaiting each XADD, "
            "1 consumer XREAD BLOCK COUNT 1000",
        )
    )
    ctx.say(f"raw baseline: {s.raw_events:,} entries, {s.raw_streams} streams")
    ctx.raw_n = run_async(
        lambda: raw.xadd_xread(engine.redis_url, engine.prefix, s.raw_events, s.raw_streams),
        ctx.use_uvloop,
    )
    rows.append(
        Row(
            f"raw redis-py XADD→XREAD, {s.raw_streams} streams",
            fmt_rate(ctx.raw_n),
            detail=f"{s.raw_events:,} entries; {s.raw_streams} producers, 1 consumer "
            f"XREADing all {s.raw_streams} keys",
        )
    )
    for streams in (1, s.raw_streams):
        ctx.say(f"raw baseline, pipelined: {s.raw_events:,} entries, {streams} stream(s)")
        rate = _pipelined(ctx, streams)
        if streams == 1:
            ctx.raw1_pipelined = rate
        else:
            ctx.raw_n_pipelined = rate
        rows.append(
            Row(
                f"raw redis-py XADD→XREAD pipelined, {streams} stream"
                + ("s" if streams > 1 else ""),
                fmt_rate(rate),
                detail=f"{s.raw_events:,} entries; {streams} producer"
                + ("s" if streams > 1 else "")
                + f" sending XADDs in pipelines of {raw.PIPELINE} (one round trip each), 1 "
                f"consumer XREAD BLOCK COUNT {raw.READ_COUNT}: the most Redis takes here",
            )
        )
    return rows


def _pipelined(ctx: Context, streams: int) -> float:
    engine = ctx.engine
    return run_async(
        lambda: raw.pipelined(engine.redis_url, engine.prefix, ctx.sizes.raw_events, streams),
        ctx.use_uvloop,
    )
