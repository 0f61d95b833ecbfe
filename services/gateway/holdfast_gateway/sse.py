"""From the event log and the hub to SSE frames.

Every logged event is sent as ``event: <type>``, ``id: <seq>``,
``data: <json>``; heartbeats carry no id (they are not part of the log).
A stream delivers each seq after its cursor exactly once and in order: live
batches are de-duplicated against what was sent, and any gap (a catch-up
that ended early, a slow client that overflowed its queue) is filled from
the log before going on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable

from holdfast_shared.eventlog import EventLog, LoggedEvent
from holdfast_shared.events import ends_turn, heartbeat_json
from sse_starlette import ServerSentEvent

from holdfast_gateway.fanout import Hub
from holdfast_gateway.sseresponse import SseResponse


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
