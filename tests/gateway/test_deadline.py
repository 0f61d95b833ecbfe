"""The gateway's bound on the time before a response starts (deadline.py): a
handler that gets no answer from a store is cut with a 503; a slow body is the
client's time and does not count; a started stream is not cut."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
from holdfast_gateway.deadline import ResponseDeadline
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

SECONDS = 0.3


async def _silent(_: Request) -> Response:
    await asyncio.Event().wait()  # a statement on a store that answers nothing
    raise AssertionError("unreachable")


async def _upload(request: Request) -> Response:
    return JSONResponse({"bytes": len(await request.body())})


async def _stream(_: Request) -> Response:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(3):
            await asyncio.sleep(SECONDS)
            yield b"x"

    return StreamingResponse(chunks())


def _client() -> httpx.AsyncClient:
    app = Starlette(
        routes=[
            Route("/silent", _silent),
            Route("/upload", _upload, methods=["POST"]),
            Route("/stream", _stream),
        ]
    )
    transport = httpx.ASGITransport(app=ResponseDeadline(app, seconds=SECONDS))
    return httpx.AsyncClient(transport=transport, base_url="http://gateway")


async def test_a_silent_store_gets_a_503_in_time() -> None:
    async with _client() as client:
        began = time.monotonic()
        reply = await client.get("/silent")
    assert reply.status_code == 503
    assert reply.json()["error"] == "UNAVAILABLE"
    assert int(reply.headers["retry-after"]) > 0
    assert time.monotonic() - began < SECONDS + 5


async def test_a_slow_body_is_not_the_store_s_time() -> None:
    async def slowly() -> AsyncIterator[bytes]:
        for _ in range(4):
            await asyncio.sleep(SECONDS)
            yield b"a" * 1000

    async with _client() as client:
        reply = await client.post("/upload", content=slowly())
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"bytes": 4000}


async def test_a_started_stream_is_not_cut() -> None:
    async with _client() as client:
        reply = await client.get("/stream")
    assert reply.status_code == 200 and reply.content == b"xxx"
