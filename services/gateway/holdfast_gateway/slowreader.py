"""A bound on what the gateway holds for one slow SSE reader.

Live events for a connection wait in its subscription's buffer
(:class:`holdfast_gateway.fanout.Subscription`) until the connection's writer
sends them; a client that reads slower than its task streams — or stops
reading, so the socket's buffers fill and every send waits — would grow that
buffer for as long as the turn runs. Past ``HOLDFAST_SSE_MAX_BUFFERED_EVENTS``
events (or ``HOLDFAST_SSE_MAX_BUFFERED_BYTES`` of them) the hub stops filling
it and trips the connection's :class:`Guard`; :class:`GuardedResponse` then
ends that response — even while a send is stuck on the client's full socket —
and with it the subscription and everything it held. The client resumes with
its cursor (``Last-Event-ID``: every frame it did get carries its seq) from
the log; nobody else's stream is touched.

The guard reaches the hub through a context variable: the response sets it in
the task that iterates its frames, and ``Hub.subscribe``, called from those
frames, picks it up — so every SSE route is covered without being changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from typing import Any

import anyio
from sse_starlette import EventSourceResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)

# How long a response that was cut off may take to end its body cleanly: a client
# whose socket is full never takes the last chunk, and the server closes it instead.
_CLEAN_END_SECONDS = 0.2

_current: ContextVar[Guard | None] = ContextVar("holdfast_sse_guard", default=None)


class Guard:
    """Tripped once the connection's buffered events went past the bound."""

    def __init__(self) -> None:
        self.tripped = asyncio.Event()
        self.reason = ""

    def trip(self, reason: str) -> None:
        if not self.tripped.is_set():
            self.reason = reason
            self.tripped.set()


def current() -> Guard | None:
    """The guard of the SSE response whose frames are being produced, if any."""
    return _current.get()


@contextlib.contextmanager
def guarding(guard: Guard) -> Iterator[None]:
    token = _current.set(guard)
    try:
        yield
    finally:
        _current.reset(token)


async def guarded(guard: Guard, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``chunks`` produced under ``guard`` (subscriptions made meanwhile report to it)."""
    with guarding(guard):
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            # Deterministically, not when the collector gets to it: the inner
            # generators hold the subscription and its buffer.
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()


class GuardedResponse(EventSourceResponse):
    """An :class:`EventSourceResponse` that ends itself when its guard trips."""

    def __init__(self, *args: Any, guard: Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        finished = False
        with anyio.CancelScope() as stream:
            watcher = asyncio.create_task(self._cut_off_when_tripped(stream))
            try:
                await super().__call__(scope, receive, send)
                finished = True
            finally:
                watcher.cancel()
        if finished or not stream.cancel_called:
            return
        log.warning("dropped a slow SSE reader: %s", self.guard.reason)
        with anyio.move_on_after(_CLEAN_END_SECONDS):
            # Ends the chunked body properly when the socket can still take it;
            # otherwise the server closes the connection once we return.
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        aclose = getattr(self.body_iterator, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()

    async def _cut_off_when_tripped(self, stream: anyio.CancelScope) -> None:
        await self.guard.tripped.wait()
        stream.cancel()
