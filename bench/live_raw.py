"""A streaming ``POST /execute`` read by a raw-socket client, for the capacity row.

With httpx, reading a few hundred live SSE streams at 50 frames/s each cost
the bench client ~35% of this 2-core machine (a coroutine, h11 and anyio
per chunk), CPU the engine it measures did not get. Here each stream is an
:class:`asyncio.Protocol`: it writes the request, checks the status line,
undoes the chunked transfer coding and hands each piece of the body to a
callback as it arrives, from the event loop's own callback: no task per
stream, no copy but the chunk's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

from bench.sse import StreamError


class _Stream(asyncio.Protocol):
    def __init__(self, request: bytes, on_body: Callable[[bytes], bool]) -> None:
        self.request = request
        self.on_body = on_body
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self._head = b""
        self._body = b""  # undecoded chunked bytes
        self._in_body = False
        self._need = -1  # bytes of the current chunk still to come (-1: a size line)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: cast, not check.
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if not self._in_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            status = self._head.split(b"\r\n", 1)[0]
            if b" 200 " not in status + b" ":
                self._finish(StreamError(f"POST /execute: {status.decode(errors='replace')}"))
                return
            if b"transfer-encoding: chunked" not in self._head[:end].lower():
                self._finish(StreamError("POST /execute: the response is not chunked"))
                return
            self._in_body = True
            data, self._head = self._head[end + 4 :], b""
        self._body += data
        self._decode()

    def _decode(self) -> None:
        buf = self._body
        pos = 0
        while True:
            if self._need < 0:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(buf[pos:eol].split(b";", 1)[0], 16)
                pos = eol + 2
                if size == 0:
                    self._finish(None)
                    return
                self._need = size
            if len(buf) - pos < self._need + 2:
                break
            piece = buf[pos : pos + self._need]
            pos += self._need + 2
            self._need = -1
            if self.on_body(piece):
                self._finish(None)
                return
        self._body = buf[pos:]

    def _finish(self, error: BaseException | None) -> None:
        if not self.done.done():
            if error is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(error)
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(
                StreamError(f"the connection closed mid-stream ({exc or 'by the server'})")
            )


async def post_stream(
    url: str, key: str, body: Mapping[str, object], on_body: Callable[[bytes], bool]
) -> None:
    """``POST {url}/execute`` with ``body``; ``on_body`` gets each piece of the response
    body as it arrives and returns True to stop reading. Returns when the
    response ends or ``on_body`` stopped it; cancelling closes the connection."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    request = (
        f"POST {parts.path or ''}/execute HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"X-Engine-Key: {key}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    loop = asyncio.get_running_loop()
    transport, stream = await loop.create_connection(
        lambda: _Stream(request, on_body), parts.hostname or "127.0.0.1", parts.port or 80
    )
    try:
        await stream.done
    finally:
        transport.close()
