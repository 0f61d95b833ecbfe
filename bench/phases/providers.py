"""A real provider SDK (Anthropic) in an instrumented loop-worker against a zero-latency
wire-protocol server: the latency it adds to the first delta, and deltas/s.

See ``bench.providers``.
"""

from __future__ import annotations

from bench import providers, raw, scenarios
from bench.context import Context, run_async
from bench.instrument import Spans
from bench.table import Row, fmt_rate

TARGET_PROVIDER_ADDED_MS = 5.0


def run(ctx: Context) -> list[Row]:
    s, engine, uv = ctx.sizes, ctx.engine, ctx.use_uvloop
    url, key = engine.gateway_url, engine.api_key
    rows: list[Row] = []
    base_note = ""
    if ctx.raw1 is None:
        n = min(s.raw_events, 20_000)
        ctx.say(f"raw baseline for the provider row: {n:,} entries, 1 stream")
        with ctx.errors_to(rows, "raw baseline (1 stream)"):
            ctx.raw1 = run_async(lambda: raw.xadd_xread(engine.redis_url, engine.prefix, n, 1), uv)
            base_note = f" Raw baseline measured in this phase ({n:,} entries)."
    label = "Provider first byte → client's first text_delta"
    ready = False
    with ctx.errors_to(rows, f"{label}: set-up"):
        spans, server = ctx.instrumented(1)
        ctx.pause("providers")
        run_async(lambda: providers.warm_up(url, key), uv)
        run_async(lambda: providers.fetch_stamps(server), uv)  # drop the warm-up's stamps
        ready = True
    if ready:
        rows += _provider_rows(ctx, url, key, server, spans, base_note)
    return rows


def _provider_rows(
    ctx: Context, url: str, key: str, server: str, spans: Spans, note: str
) -> list[Row]:
    s, uv, pct = ctx.sizes, ctx.use_uvloop, scenarios.percentile
    rows: list[Row] = []
    label = "Provider first byte → client's first text_delta"
    ctx.say(f"{label}: {s.provider_turns} sequential turns")
    lat = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
        lat = run_async(
            lambda: providers.first_delta_latency(url, key, server, s.provider_turns, 10, spans),
            uv,
        )
    if lat is not None:
        split = (
            f" Split at p50: server first byte → the worker starts the append carrying "
            f"the first delta (httpx + SDK SSE parsing of message_start, "
            f"content_block_start, ping, the delta; translation; emit) "
            f"{pct(lat.to_emit_ms, 50):.2f} ms; that append (Lua XADD) "
            f"{pct(lat.append_ms, 50):.2f} ms; append done → client parsed the frame "
            f"(gateway XREAD fan-out, SSE, loopback, httpx) {pct(lat.to_client_ms, 50):.2f} ms."
            if lat.to_emit_ms
            else ""
        )
        rows.append(
            Row(
                f"{label} (Anthropic SDK, zero-latency wire server)",
                f"p50 {lat.p50:.2f} ms\np99 {lat.p99:.2f} ms",
                target=f"added p50 ≤ {TARGET_PROVIDER_ADDED_MS:g} ms",
                detail=f"{s.provider_turns} sequential turns on new tasks after 10 warm-up, "
                f"3 deltas each; the server (own process) stamps perf_counter as its response "
                f"yields message_start, the client as it parses the first text_delta frame "
                f"(CLOCK_MONOTONIC: one clock for all processes).{split} For context: POST "
                f"sent → request at the provider p50 {pct(lat.to_provider_ms, 50):.1f} ms; POST "
                f"→ first delta p50 {pct(lat.post_to_delta_ms, 50):.1f} ms. CPU: "
                f"{cpu.summary()}. {pg.summary()}",
                ok=lat.p50 <= TARGET_PROVIDER_ADDED_MS,
            )
        )
    label = f"Provider stream → SSE text_delta, 1 turn x {s.provider_deltas:,}, 1 worker"
    ctx.say(label)
    thr = None
    with ctx.errors_to(rows, label), ctx.measured() as (cpu, pg):
        thr = run_async(lambda: providers.throughput(url, key, server, s.provider_deltas), uv)
    if thr is not None:
        ratio = thr.from_post / ctx.raw1 if ctx.raw1 else None
        rows.append(
            Row(
                label,
                f"{fmt_rate(thr.from_post)}\n(steady {fmt_rate(thr.steady)})",
                fmt_rate(ctx.raw1) if ctx.raw1 else "n/a",
                f"{ratio:.2f}" if ratio is not None else "n/a",
                "(none set)",
                f"POST sent → last delta received (steady: first → last delta); the Anthropic "
                f"SDK in the worker reads a zero-delay server that wrote all "
                f"{thr.deltas + 6:,} events ({providers.BATCH_EVENTS} per write) in "
                f"{thr.server_seconds * 1000:.0f} ms; the last delta reached the client "
                f"{thr.server_to_client_last_ms:.0f} ms after the server's last byte. "
                f"{thr.deltas:,} deltas in {thr.chunks:,} HTTP chunks, {thr.wall:.2f} s. CPU: "
                f"{cpu.summary()}. {pg.summary()}.{note}",
            )
        )
    return rows
