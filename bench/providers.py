"""A real provider SDK in the loop-worker, against a zero-latency provider server.

The server is the test suite's wire-protocol fake (``tests.providers.wire``
``WireServer`` + ``fake_anthropic`` replies: real uvicorn, the Anthropic
Messages API's streaming events) run in its own process, so it shares no
CPU time slice or GIL with the bench client. :class:`StampingServer` adds,
per request:

* the reply's size, read from a tag in the user's message
  (``hfbench-<tag>-<n>``: ``n`` text deltas);
* ``time.perf_counter()`` when the request arrived, when the response
  yielded its first event (its first body byte, ``message_start``), the
  first ``content_block_delta``, and after the last event.

On Linux ``perf_counter`` is ``clock_gettime(CLOCK_MONOTONIC)``: one clock for
every process on the machine, so the server's stamps and the client's
receive times subtract directly (the bench checks the clock at start-up).

The loop-worker runs with ``ANTHROPIC_API_KEY=x`` and
``ANTHROPIC_BASE_URL=<server>``; each turn is
``POST /execute {"message": ..., "model": "anthropic:claude-sonnet-4-6"}``.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.instrument import Spans
from bench.scenarios import new_client, percentile
from bench.sse import SSECount, StreamError, stream

MODEL = "anthropic:claude-sonnet-4-6"
TAG = re.compile(rb"hfbench-(\w+)-(\d+)")
# Events per body write for big replies: the server is then not what limits
# the rate (a real API's TCP segments carry several events too).
BATCH_EVENTS = 100
LATENCY_CHUNKS = ["Hel", "lo ", "there"]


def check_clock() -> str:
    """perf_counter must be the machine-wide monotonic clock for cross-process stamps."""
    info = time.get_clock_info("perf_counter")
    if sys.platform != "linux" or "CLOCK_MONOTONIC" not in info.implementation:
        raise RuntimeError(
            f"perf_counter is {info.implementation} on {sys.platform}: stamps taken in "
            "different processes cannot be compared"
        )
    return str(info.implementation)


# -- the server (runs in its own process) ---------------------------------------------------------
def _server_class() -> Any:
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse

    from tests.providers import fake_anthropic
    from tests.providers.wire import Reply, WireServer

    class StampingServer(WireServer):
        """Answers every ``POST /v1/messages`` with a text reply sized by the
        request's tag, stamping when the response's bytes leave;
        ``GET /_bench/stamps`` returns (and clears) the stamps by tag."""

        def __init__(self) -> None:
            super().__init__()
            self.stamps: dict[str, dict[str, float]] = {}

        async def _handle(self, request: Request) -> Response:
            arrived = time.perf_counter()
            if request.path_params["path"] == "_bench/stamps":
                out, self.stamps = self.stamps, {}
                return JSONResponse(out)
            raw = await request.body()
            match = TAG.search(raw)
            if match is None:
                return JSONResponse({"error": "no hfbench tag in the request"}, status_code=400)
            tag, n = match.group(1).decode(), int(match.group(2))
            stamp = self.stamps[tag] = {"arrived": arrived}
            chunks = LATENCY_CHUNKS if n == len(LATENCY_CHUNKS) else ["x"] * n
            reply = fake_anthropic.text_reply(
                chunks, fake_anthropic.Usage(input_tokens=25, output_tokens=n)
            )
            batch = BATCH_EVENTS if n > 100 else 1
            return StreamingResponse(
                self._timed(reply, stamp, batch), media_type="text/event-stream"
            )

        async def _timed(
            self, reply: Reply, stamp: dict[str, float], batch: int
        ) -> AsyncIterator[bytes]:
            events = reply.events or []
            first_delta = next(i for i, e in enumerate(events) if e.event == "content_block_delta")
            for start in range(0, len(events), batch):
                part = events[start : start + batch]
                body = b"".join(e.encode() for e in part)
                now = time.perf_counter()
                stamp.setdefault("first_byte", now)
                if "first_delta" not in stamp and start + len(part) > first_delta:
                    stamp["first_delta"] = now
                yield body
            stamp["last_byte"] = time.perf_counter()

    return StampingServer


def serve() -> None:
    """Entry point of the server process: prints its URL, then serves until killed."""
    server = _server_class()().start()
    print(server.url, flush=True)
    threading.Event().wait()


SERVER_CODE = "from bench.providers import serve; serve()"


async def fetch_stamps(server_url: str) -> dict[str, dict[str, float]]:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.get(f"{server_url}/_bench/stamps")
        response.raise_for_status()
        return dict(response.json())


# -- 1. provider first byte → client's first text_delta -----------------------------------------
@dataclass
class ProviderLatency:
    added_ms: list[float]  # server first byte → client parsed the first text_delta
    to_provider_ms: list[float]  # POST sent → request arrived at the provider
    post_to_delta_ms: list[float]  # POST sent → first text_delta parsed
    # From the instrumented worker: server first byte → the worker starts the
    # append carrying the first delta (SDK, translation, emit); that append;
    # its end → the client parsed it (gateway fan-out, SSE, loopback, client).
    to_emit_ms: list[float] = field(default_factory=list)
    append_ms: list[float] = field(default_factory=list)
    to_client_ms: list[float] = field(default_factory=list)

    @property
    def p50(self) -> float:
        return percentile(self.added_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.added_ms, 99)


async def first_delta_latency(
    url: str, key: str, server_url: str, turns: int, warmup: int, spans: Spans | None
) -> ProviderLatency:
    """Sequential turns on new tasks, three text deltas each."""
    n = len(LATENCY_CHUNKS)
    got: dict[str, SSECount] = {}
    async with new_client() as client:
        for i in range(warmup + turns):
            tag = f"l{i}"
            body = {"message": f"hfbench-{tag}-{n} please say hello", "model": MODEL}
            count = await stream(client, "POST", f"{url}/execute", key=key, json_body=body)
            if count.phase != "completed" or count.deltas != n:
                raise StreamError(
                    f"provider turn ended {count.phase!r} with {count.deltas}/{n} deltas "
                    f"{count.errors}"
                )
            if i >= warmup:
                got[tag] = count
    stamps = await fetch_stamps(server_url)
    out = ProviderLatency([], [], [])
    if spans is not None:
        spans.reload()
    for tag, count in got.items():
        stamp = stamps.get(tag)
        if stamp is None or "first_byte" not in stamp:
            raise StreamError(f"the provider server has no stamps for turn {tag}")
        out.added_ms.append((count.first_delta_at - stamp["first_byte"]) * 1000)
        out.to_provider_ms.append((stamp["arrived"] - count.opened_at) * 1000)
        out.post_to_delta_ms.append((count.first_delta_at - count.opened_at) * 1000)
        appends = spans.of(count.turn_id or "", "append.text") if spans is not None else []
        if appends:
            start, end = appends[0]
            out.to_emit_ms.append((start - stamp["first_byte"]) * 1000)
            out.append_ms.append((end - start) * 1000)
            out.to_client_ms.append((count.first_delta_at - end) * 1000)
    return out


# -- 2. deltas/s through the whole path ----------------------------------------------------------
@dataclass
class ProviderThroughput:
    deltas: int
    from_post: float
    steady: float
    wall: float
    chunks: int
    server_seconds: float  # first byte → last byte written by the server
    server_to_client_last_ms: float  # server's last byte → client's last delta


async def throughput(url: str, key: str, server_url: str, deltas: int) -> ProviderThroughput:
    body = {"message": f"hfbench-t-{deltas} stream a lot", "model": MODEL}
    async with new_client() as client:
        got = await stream(client, "POST", f"{url}/execute", key=key, json_body=body)
    if got.phase != "completed" or got.deltas != deltas:
        raise StreamError(
            f"provider turn ended {got.phase!r} with {got.deltas}/{deltas} deltas {got.errors}"
        )
    stamp = (await fetch_stamps(server_url))["t"]
    return ProviderThroughput(
        deltas=deltas,
        from_post=deltas / (got.last_delta_at - got.opened_at),
        steady=deltas / max(got.last_delta_at - got.first_delta_at, 1e-9),
        wall=got.ended_at - got.opened_at,
        chunks=got.chunks,
        server_seconds=stamp["last_byte"] - stamp["first_byte"],
        server_to_client_last_ms=(got.last_delta_at - stamp["last_byte"]) * 1000,
    )


async def warm_up(url: str, key: str, turns: int = 5) -> None:
    """Provider turns that are not timed: the SDK client's connection, imports, caches."""
    n = len(LATENCY_CHUNKS)
    async with new_client() as client:
        for i in range(turns):
            body = {"message": f"hfbench-w{i}-{n} warm up", "model": MODEL}
            got = await stream(client, "POST", f"{url}/execute", key=key, json_body=body)
            if got.phase != "completed":
                raise StreamError(f"provider warm-up turn ended {got.phase!r} {got.errors}")
        body = {"message": "hfbench-w-2000 warm up", "model": MODEL}
        await stream(client, "POST", f"{url}/execute", key=key, json_body=body)
