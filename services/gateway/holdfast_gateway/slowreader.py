"""A bound on what the gateway holds for one slow SSE reader.

Live events for a connection wait in its subscription's buffer
(:class:`holdfast_gateway.fanout.Subscription`) until the connection's writer
sends them; a client that reads slower than its task streams — or stops
reading, so the socket's buffers fill and every send waits — would grow that
buffer for as long as the turn runs. Past ``HOLDFAST_SSE_MAX_BUFFERED_EVENTS``
events (or ``HOLDFAST_SSE_MAX_BUFFERED_BYTES`` of them) the hub stops filling
it and trips the connection's :class:`Guard`; the response
(:class:`holdfast_gateway.sse.SseResponse`) then ends — even while a
send is stuck on the client's full socket — and with it the subscription and
everything it held. The client resumes with its cursor (``Last-Event-ID``:
every frame it did get carries its seq) from the log; nobody else's stream is
touched.

The guard reaches the hub through a context variable: the response sets it in
the task that iterates its frames, and ``Hub.subscribe``, called from those
frames, picks it up — so every SSE route is covered without being changed.
A guard is a reason and a callback, no task or event of its own: with ten
thousand idle connections on a gateway every object per connection counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

_current: ContextVar[Guard | None] = ContextVar("holdfast_sse_guard", default=None)


class Guard:
    """Tripped once the connection's buffered events went past the bound."""

    __slots__ = ("_on_trip", "reason")

    def __init__(self, on_trip: Callable[[str], None]) -> None:
        self.reason = ""
        self._on_trip = on_trip

    @property
    def tripped(self) -> bool:
        return bool(self.reason)

    def trip(self, reason: str) -> None:
        if not self.reason:
            self.reason = reason
            self._on_trip(reason)


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
