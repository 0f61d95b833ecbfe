"""A cap on request bodies: 413 ``BODY_TOO_LARGE`` before a body is read whole.

A pure ASGI middleware. A ``Content-Length`` over the cap is answered at
once, without reading a byte of the body and without running the app.
Otherwise (a chunked body, or one longer than it said) the bytes are counted
as the app receives them, and the chunk that crosses the cap raises
:class:`BodyTooLarge` from ``receive()``: an ``HTTPException``, so FastAPI's
body reading passes it on to the error handlers (``errors.py``), which
answer with the JSON error; if it escapes elsewhere before a response has
started, this middleware answers itself.

The connection is not closed after a 413: a client that sends its whole body
before reading (most do) would get a reset instead of the answer. The
server drops the rest of the body as it arrives, without keeping it.
"""

from __future__ import annotations

from holdfast_shared.errors import ErrorCode
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from holdfast_gateway.errors import error_body


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than {limit} bytes")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send)
            return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than {self.max_bytes} bytes"
        response = JSONResponse(error_body(ErrorCode.BODY_TOO_LARGE, message), 413)
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
