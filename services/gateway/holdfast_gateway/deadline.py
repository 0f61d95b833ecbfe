"""A bound on the time before a request is answered: 503 ``UNAVAILABLE``, never a hang.

A store that stops answering without refusing (a PostgreSQL or Redis that is
stalled, partitioned away, or behind a middlebox that drops packets) gives
the drivers nothing to raise: a statement sent on a pooled connection waits
for a reply that never comes. Each request is therefore given
``HOLDFAST_REQUEST_TIMEOUT_SECONDS`` to *start* its response. Past it the
client gets the same retryable 503 as for a store that refuses
(``errors.py``), with ``Retry-After``, and the handler is cancelled in the
background (psycopg then cancels its query and closes the connection if the
server does not answer that either, within seconds): the client is not kept
waiting for that clean-up.

Only the start is bounded, and counted from the end of the request's body
(a skill upload over a slow link is the client's time, not a store's): an SSE
stream, once its headers are sent, runs as long as its turn; its own
heartbeats say it is alive.
"""

from __future__ import annotations

import asyncio
import logging

from holdfast_shared.errors import ErrorCode
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from holdfast_gateway.errors import error_body

log = logging.getLogger(__name__)

# How many deadlines a request's body may take to arrive (an 8 MiB body in
# 300 s: 28 KB/s) before the handler's own clock starts.
_BODY_ALLOWANCE = 10


class ResponseDeadline:
    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds
        # Handlers cancelled after their deadline, held until their clean-up ends.
        self._abandoned: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = asyncio.Event()
        received = asyncio.Event()
        if not _has_body(scope):
            received.set()
        abandoned = False

        async def tracking_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                received.set()
            return message

        async def tracking_send(message: Message) -> None:
            if abandoned:
                return  # the client was answered already: what the handler says is dropped
            if message["type"] == "http.response.start":
                started.set()
            await send(message)

        async def handle() -> None:
            await self.app(scope, tracking_receive, tracking_send)

        handler = asyncio.create_task(handle())
        start = asyncio.create_task(started.wait())
        body = asyncio.create_task(received.wait())
        try:
            # The clock starts once the body is in (or the handler answered);
            # a handler that waits before reading it is bounded too, generously.
            await asyncio.wait(
                {handler, start, body},
                timeout=self.seconds * _BODY_ALLOWANCE,
                return_when=asyncio.FIRST_COMPLETED,
            )
            await asyncio.wait(
                {handler, start}, timeout=self.seconds, return_when=asyncio.FIRST_COMPLETED
            )
            if handler.done() or started.is_set():
                await handler
                return
            abandoned = True
            handler.cancel()
            self._abandoned.add(handler)
            handler.add_done_callback(self._forget)
            log.warning(
                "%s %s: no answer within %.0f s (a store is not answering): 503",
                scope.get("method"),
                scope.get("path"),
                self.seconds,
            )
            await _unavailable(scope, receive, send, self.seconds)
        finally:
            start.cancel()
            body.cancel()
            if not handler.done() and not abandoned:
                # The server cancelled us (the client went away): the handler goes too.
                handler.cancel()

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._abandoned.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("an abandoned request ended with %r", task.exception())


def _has_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return False


async def _unavailable(scope: Scope, receive: Receive, send: Send, seconds: float) -> None:
    message = f"no answer from a backing store within {seconds:g} s; retry shortly"
    response = JSONResponse(
        error_body(ErrorCode.UNAVAILABLE, message), 503, headers={"Retry-After": "5"}
    )
    await response(scope, receive, send)
