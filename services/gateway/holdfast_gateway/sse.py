"""From the event log and the hub to SSE frames, and the response that sends them.

Frames. Every logged event is sent as ``event: <type>``, ``id: <seq>``,
``data: <json>``; heartbeats carry no id (they are not part of the log).
A stream delivers each seq after its cursor exactly once and in order: live
batches are de-duplicated against what was sent, and any gap (a catch-up
that ended early, a slow client that overflowed its queue) is filled from
the log before going on.

The response. :class:`SseResponse` costs one coroutine per connection.
sse-starlette's ``EventSourceResponse`` runs four tasks in an anyio task
group per connection (the body, pings, the disconnect listener, the shutdown
listener) with their cancel scopes, events and a lock. With ten thousand idle
streams on one gateway that machinery, not the streams, was most of the
memory (~57 KB a connection by tracemalloc). :class:`SseResponse` keeps the
same wire behaviour — the headers, ``event:``/``data:`` frames, a heartbeat
every ``ping`` seconds, HEAD answered without a stream — with:

* the frames sent from the request's own task;
* a timer per connection for the heartbeat: when it fires, a short-lived task
  checks whether the client is gone (Starlette's ``Request.is_disconnected``:
  a receive that returns at once or not at all) and sends the heartbeat. A
  client that left is noticed at its next heartbeat (``HOLDFAST_HEARTBEAT_SECONDS``);
  until then its frames go nowhere, as the server drops them;
* the slow-reader guard (``slowreader.py``), gateway shutdown and a departed
  client all stop the stream the same way: the request's task is cancelled
  with a reason, the cancellation is taken back here, and the frames'
  generator is closed (its ``finally`` drops the subscription).

Each ping is written whole by one ``send`` (the server writes a message in
one piece), so a heartbeat racing a frame lands before or after it, never
inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Literal

from holdfast_shared.eventlog import EventLog, LoggedEvent
from holdfast_shared.events import ends_turn, heartbeat_json
from sse_starlette import ServerSentEvent
from sse_starlette.sse import AppStatus
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from holdfast_gateway.fanout import Hub
from holdfast_gateway.slowreader import Guard, guarding

log = logging.getLogger(__name__)


def frame(event: LoggedEvent) -> str:
    return f"event: {event.type}\r\nid: {event.seq}\r\ndata: {event.data}\r\n\r\n"


class _Progress:
    """What one stream has sent so far and whether it is finished."""

    __slots__ = ("_stop_turn", "done", "last")

    def __init__(self, after_seq: int, stop_turn: str | None) -> None:
        self.last = after_seq
        self.done = False
        self._stop_turn = stop_turn

    def take(self, events: Iterable[LoggedEvent]) -> str:
        """Frames for the events not sent yet, stopping after the terminal one."""
        out: list[str] = []
        for event in events:
            if event.seq <= self.last:
                continue
            out.append(frame(event))
            self.last = event.seq
            if self._stop_turn is not None and ends_turn(event.type, event.data, self._stop_turn):
                self.done = True
                break
        return "".join(out)


async def event_frames(
    hub: Hub,
    eventlog: EventLog,
    task_id: str,
    after_seq: int,
    *,
    stop_turn: str | None,
    follow_for: float | None = None,
) -> AsyncIterator[str]:
    """The task's events after ``after_seq``, then live ones.

    With ``stop_turn`` the stream ends after that turn's terminal lifecycle
    event; without it, it ends once the stored events are sent — unless
    ``follow_for`` is given: then it follows every later turn of the task
    (``stop_turn`` is ignored) and ends after that many seconds.
    """
    deadline = 0.0
    if follow_for is not None:
        stop_turn = None
        deadline = asyncio.get_running_loop().time() + follow_for
    progress = _Progress(after_seq, stop_turn)
    sub = await hub.subscribe(task_id)
    try:
        async for chunk in _from_log(eventlog, task_id, progress):
            yield chunk
        if progress.done or (stop_turn is None and follow_for is None):
            return
        chunk = ""  # the last one is not held while the stream idles
        while not progress.done:
            if follow_for is None:
                batch = await sub.queue.get()
            else:
                try:
                    async with asyncio.timeout(deadline - asyncio.get_running_loop().time()):
                        batch = await sub.queue.get()
                except TimeoutError:
                    return
            if batch is None:
                return  # the gateway is shutting down
            if batch[-1].seq <= progress.last:
                continue
            if batch[0].seq > progress.last + 1 or sub.overflowed:
                sub.overflowed = False
                async for chunk in _from_log(eventlog, task_id, progress):
                    yield chunk
            chunk = progress.take(batch)
            if chunk:
                yield chunk
    finally:
        hub.unsubscribe(sub)


async def _from_log(eventlog: EventLog, task_id: str, progress: _Progress) -> AsyncIterator[str]:
    async for page in eventlog.pages_after(task_id, progress.last):
        chunk = progress.take(page)
        if chunk:
            yield chunk
        if progress.done:
            return


def sse_response(
    frames: AsyncIterator[str],
    task_id: str,
    heartbeat_seconds: float,
    headers: dict[str, str] | None = None,
) -> SseResponse:
    def heartbeat() -> ServerSentEvent:
        return ServerSentEvent(
            event="heartbeat", data=heartbeat_json(task_id, int(time.time() * 1000))
        )

    # A reader too slow for its stream is dropped, not buffered for (slowreader.py).
    return SseResponse(
        frames,
        ping_seconds=heartbeat_seconds,
        ping=heartbeat,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )


# -- the response ------------------------------------------------------------------------------
# How long a response that was cut off may take to end its body cleanly: a client
# whose socket is full never takes the last chunk, and the server closes it instead.
_CLEAN_END_SECONDS = 0.2
# How often the shutdown watcher looks at uvicorn's exit flag (via sse-starlette).
_SHUTDOWN_POLL_SECONDS = 0.5

StopReason = Literal["slow", "gone", "shutdown"]

# Header lists shared by responses with the same headers (bounded: a turn's
# response carries its own ids).
_HEADERS: dict[tuple[tuple[bytes, bytes], ...], list[tuple[bytes, bytes]]] = {}
_HEADERS_KEPT = 64


class SseResponse(Response):
    """``text/event-stream`` from an async iterator of ready-made SSE frames."""

    def __init__(
        self,
        frames: AsyncIterator[str],
        *,
        ping_seconds: float,
        ping: Callable[[], ServerSentEvent],
        headers: Mapping[str, str] | None = None,
        status_code: int = 200,  # FastAPI's OpenAPI reads the default status here
    ) -> None:
        self.status_code = status_code
        # Set here, not on the class: FastAPI's OpenAPI takes a class media type
        # for every response of the route, its JSON errors too (as sse-starlette).
        self.media_type = "text/event-stream"
        self.background = None
        self.init_headers(
            {
                "Cache-Control": "no-store",
                "Connection": "keep-alive",
                "X-Accel-Buffering": "no",
                **(headers or {}),
            }
        )
        # Every replay has the same headers: one list for all of them (read
        # only — nothing sets headers on a response once it is made).
        key = tuple(self.raw_headers)
        shared = _HEADERS.get(key)
        if shared is None:
            if len(_HEADERS) >= _HEADERS_KEPT:
                _HEADERS.clear()
            shared = _HEADERS[key] = self.raw_headers
        self.raw_headers = shared
        self._frames = frames
        self._ping_seconds = ping_seconds
        self._ping = ping
        self._task: asyncio.Task[object] | None = None
        self._stop: StopReason | None = None
        self._stops_requested = 0
        self._ended = False
        self._streaming = False
        self._pinging: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {
            "type": "http.response.start",
            "status": self.status_code,
            "headers": self.raw_headers,
        }
        if scope["method"] == "HEAD":
            # An endless stream would never complete a HEAD (as sse-starlette).
            await send(start)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        self._task = asyncio.current_task()
        guard = Guard(lambda _reason: self._request_stop("slow"))
        await send(start)
        _live.add(self)
        _watch_shutdown()
        self._schedule_ping(scope, receive, send)
        try:
            with guarding(guard):
                await self._stream(send)
        except asyncio.CancelledError:
            if not self._take_back_stop():
                raise
        finally:
            self._streaming = False
            _live.discard(self)
            if self._timer is not None:
                self._timer.cancel()
            # Here, not when the collector gets to it: the generators hold the
            # subscription and its buffer.
            await self._frames.aclose()  # type: ignore[attr-defined]
        await self._end(send, guard)

    async def _stream(self, send: Send) -> None:
        # Cancelled only in here (``_streaming``), so a stop is always taken
        # back by ``__call__``'s handler, never raised out of its cleanup.
        self._streaming = True
        if self._stop is not None:
            return
        async for chunk in self._frames:
            body = chunk.encode()
            del chunk  # not held while the stream idles
            await send({"type": "http.response.body", "body": body, "more_body": True})
            del body

    async def _end(self, send: Send, guard: Guard) -> None:
        self._ended = True
        if self._stop == "slow":
            log.warning("dropped a slow SSE reader: %s", guard.reason)
        if self._stop == "gone":
            return
        # Ends the chunked body properly when the socket can still take it;
        # otherwise the server closes the connection once we return.
        with contextlib.suppress(TimeoutError, OSError, RuntimeError):
            async with asyncio.timeout(_CLEAN_END_SECONDS if self._stop else None):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    # -- stopping from outside the request's task ---------------------------------------------
    def _request_stop(self, reason: StopReason) -> None:
        if self._stop is not None or self._ended:
            return
        self._stop = reason
        task = self._task
        if self._streaming and task is not None and not task.done():
            self._stops_requested += 1
            task.cancel()

    def _take_back_stop(self) -> bool:
        """True when every pending cancellation of the task is one of ours."""
        task = self._task
        if task is None or self._stops_requested == 0:
            return False
        if task.cancelling() > self._stops_requested:
            return False
        for _ in range(self._stops_requested):
            task.uncancel()
        self._stops_requested = 0
        return True

    # -- heartbeats -----------------------------------------------------------------------------
    def _schedule_ping(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._ping_seconds <= 0:
            return
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._ping_seconds, self._on_timer, scope, receive, send)

    def _on_timer(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._ended:
            return
        self._schedule_ping(scope, receive, send)
        if self._pinging is None:  # else the last one still waits on a full socket
            self._pinging = asyncio.create_task(self._ping_once(scope, receive, send))

    async def _ping_once(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # In this short-lived task, not the request's: the check cancels
            # the task that makes it.
            if await Request(scope, receive).is_disconnected():
                self._request_stop("gone")
                return
            if not self._ended:
                body = self._ping().encode()
                await send({"type": "http.response.body", "body": body, "more_body": True})
        except Exception:
            # The response ended meanwhile (the server refuses a body after the
            # last one) or the connection broke: the request's task sees to it.
            log.debug("heartbeat not sent", exc_info=True)
        finally:
            self._pinging = None


# -- shutdown ----------------------------------------------------------------------------------
_live: set[SseResponse] = set()
_watcher: asyncio.Task[None] | None = None


def _watch_shutdown() -> None:
    """One watcher per process: when uvicorn begins to exit (sse-starlette's
    ``AppStatus`` hook on its signal handler), every open stream ends at once
    instead of holding the graceful shutdown until it times out."""
    global _watcher
    if _watcher is None or _watcher.done():
        _watcher = asyncio.get_running_loop().create_task(_shutdown_watcher())


async def _shutdown_watcher() -> None:
    while _live:
        if AppStatus.should_exit:
            for response in list(_live):
                response._request_stop("shutdown")
            return
        await asyncio.sleep(_SHUTDOWN_POLL_SECONDS)
