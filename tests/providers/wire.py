"""Local HTTP servers that stand in for model providers, speaking their wire protocol.

A :class:`WireServer` runs a real uvicorn server on 127.0.0.1 in a thread and
answers every POST with the next scripted :class:`Reply` (or the reply a
queued :data:`Responder` computes from the request), recording each
request (path, headers, JSON body and its raw bytes) so tests can check what
the SDK sent. The provider-specific modules (``fake_anthropic`` …) build the
replies: the event names, fields and ordering each real API sends. They also
hold each API's request checks (``refuse``): a request the real API answers
with a 400 — a tool call without its result, a result without its call —
gets that 400 here too, before any scripted reply is used.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class SSE:
    """One server-sent event; ``event`` None for data-only streams (OpenAI, Gemini)."""

    data: Any
    event: str | None = None

    def encode(self) -> bytes:
        payload = self.data if isinstance(self.data, str) else json.dumps(self.data)
        head = f"event: {self.event}\n" if self.event else ""
        return f"{head}data: {payload}\n\n".encode()


@dataclass
class Reply:
    """What the server answers to one request.

    ``events`` → a ``text/event-stream`` body; ``body`` → a JSON body (errors,
    non-streaming); ``break_after`` → drop the connection after that many
    events, as a reset mid-stream would, ``break_inside`` bytes into the next
    one (a line cut in half: a tool call's JSON, say). ``first_delay`` holds
    the answer back, headers and all; ``endless`` is sent again and again
    after ``events`` (every ``delay_between``), a stream that never stops.
    """

    status: int = 200
    events: list[SSE] | None = None
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    break_after: int | None = None
    break_inside: int = 0
    delay_between: float = 0.0
    first_delay: float = 0.0
    endless: SSE | None = None


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    json: Any
    # The body as sent, byte for byte: what a prompt cache keyed on the prefix sees.
    raw: bytes = b""


# A request check: the error reply the real API would send, or None to go on.
Refusal = Callable[[Recorded], Reply | None]
# A reply computed from its request (embeddings answer what was sent).
Responder = Callable[[Recorded], Reply]


class WireServer:
    def __init__(self, checks: Sequence[Refusal] = ()) -> None:
        self.checks = tuple(checks)
        self.replies: deque[Reply | Responder] = deque()
        self.requests: list[Recorded] = []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["POST", "GET"])])
        self._server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
            )
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def queue(self, *replies: Reply | Responder) -> None:
        self.replies.extend(replies)

    def start(self) -> WireServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("wire server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    async def _handle(self, request: Request) -> Response:
        raw = await request.body()
        recorded = Recorded(
            request.method,
            "/" + request.path_params["path"],
            request.url.query,
            dict(request.headers),
            json.loads(raw) if raw else None,
            raw,
        )
        self.requests.append(recorded)
        for check in self.checks:
            refused = check(recorded)
            if refused is not None:
                return JSONResponse(refused.body, status_code=refused.status)
        if not self.replies:
            return JSONResponse({"error": "no scripted reply left"}, status_code=599)
        queued = self.replies.popleft()
        reply = queued if isinstance(queued, Reply) else queued(recorded)
        if reply.first_delay:
            await asyncio.sleep(reply.first_delay)
        if reply.events is None:
            return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
        return StreamingResponse(
            self._stream(reply),
            status_code=reply.status,
            media_type="text/event-stream",
            headers=reply.headers,
        )

    async def _stream(self, reply: Reply) -> AsyncIterator[bytes]:
        assert reply.events is not None
        for i, event in enumerate(reply.events):
            if reply.break_after is not None and i >= reply.break_after:
                if reply.break_inside:
                    yield event.encode()[: reply.break_inside]
                # Raising inside the body iterator makes uvicorn abort the
                # connection without a proper chunked terminator: a reset.
                raise ConnectionResetError("scripted connection drop")
            if reply.delay_between:
                await asyncio.sleep(reply.delay_between)
            yield event.encode()
        while reply.endless is not None:
            await asyncio.sleep(reply.delay_between)
            yield reply.endless.encode()
