"""The bench's SSE client: httpx raw chunks, one frame parser, two records.

:class:`SSEParser` is the one parser: it keeps the incomplete tail of a
response and hands back the complete frames of each chunk as (event, data)
pairs. It runs in one of two modes:

* counting (the default), for the throughput, latency and idle rows:
  ``text_delta`` frames are only counted, with ``bytes.count`` (C speed), and
  a regular expression picks out the few other frames (lifecycle, error,
  heartbeat), so the client costs a small fraction of a microsecond per
  ``text_delta`` frame. ``bench.phases.e2e`` checks that claim each run by
  re-feeding a recorded stream;
* every frame, for the low-volume rows (tool round trips, recovery), where
  each frame's receive time and body matter, not the rate.

:class:`SSECount` keeps the counts and times of a response read in the first
mode, :class:`Frames` every decoded frame of one read in the second; both are
filled by :func:`stream` / :func:`stream_frames`, one reading loop.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import httpx

_DELTA_LINE = b"event: text_delta"
_HEARTBEAT = b"heartbeat"
# A frame: its event name and its (one) data line. The gateway writes
# ``event:``, ``id:``, ``data:`` in that order (holdfast_gateway.sse.frame);
# heartbeats have no id.
_FRAME_REST = rb" ?([^\r\n]*)\r?\n(?:id:[^\r\n]*\r?\n)?(?:data: ?([^\r\n]*))?"
_ANY_FRAME = re.compile(rb"event:" + _FRAME_REST)
_OTHER_FRAME = re.compile(rb"event:(?! ?text_delta\r?\n)" + _FRAME_REST)
_DECODED = frozenset({b"thread_lifecycle", b"error"})


class StreamError(RuntimeError):
    pass


class SSEParser:
    """Splits one response's bytes into frames, looking only at complete ones
    (up to the last blank line); the rest waits for the next chunk."""

    __slots__ = ("_buf", "_every_frame")

    def __init__(self, *, every_frame: bool = False) -> None:
        self._buf = b""
        self._every_frame = every_frame

    def feed(self, chunk: bytes) -> tuple[int, list[tuple[bytes, bytes]]]:
        """The frames completed by ``chunk``: ``(n, frames)``.

        Counting, ``n`` is the number of ``text_delta`` frames and ``frames``
        the other frames as ``(event, data)`` (``data`` is ``b""`` when the
        frame has none). With ``every_frame``, ``n`` is 0 and ``frames`` holds
        every frame, in order.
        """
        buf = self._buf + chunk if self._buf else chunk
        crlf = buf.rfind(b"\r\n\r\n")
        lf = buf.rfind(b"\n\n")
        end = max(crlf + 4 if crlf >= 0 else 0, lf + 2 if lf >= 0 else 0)
        if not end:
            self._buf = buf
            return 0, []
        if end == len(buf):
            region, self._buf = buf, b""
        else:
            region, self._buf = buf[:end], buf[end:]
        if self._every_frame:
            return 0, _ANY_FRAME.findall(region)
        deltas = region.count(_DELTA_LINE)
        if region.count(b"event:") == deltas:
            return deltas, []
        return deltas, _OTHER_FRAME.findall(region)


@dataclass(slots=True)
class SSECount:
    """What one SSE response carried, counted as it arrives."""

    opened_at: float = 0.0  # request sent (perf_counter)
    first_chunk_at: float = 0.0
    started_at: float = 0.0  # thread_lifecycle started received
    first_delta_at: float = 0.0
    last_delta_at: float = 0.0
    ended_at: float = 0.0  # terminal lifecycle received
    frames: int = 0
    deltas: int = 0
    chunks: int = 0
    phase: str | None = None  # last lifecycle phase
    errors: list[str] = field(default_factory=list)
    heartbeats: list[float] = field(default_factory=list)  # client receive times
    heartbeat_server_ms: list[int] = field(default_factory=list)
    task_id: str | None = None
    turn_id: str | None = None
    _parser: SSEParser = field(default_factory=SSEParser, repr=False)

    @property
    def done(self) -> bool:
        return self.phase in ("completed", "errored")

    def feed(self, chunk: bytes, now: float) -> None:
        """Consume one network chunk received at ``now``: ``text_delta`` frames
        are counted, the data of lifecycle, error and heartbeat frames decoded."""
        self.chunks += 1
        if not self.first_chunk_at:
            self.first_chunk_at = now
        deltas, others = self._parser.feed(chunk)
        for event, data in others:
            if event in _DECODED:
                self._decoded(event, data, now)
            elif event == _HEARTBEAT:
                self.heartbeats.append(now)
                if data:
                    self.heartbeat_server_ms.append(json.loads(data)["timestamp"])
        if deltas:
            self.deltas += deltas
            if not self.first_delta_at:
                self.first_delta_at = now
            self.last_delta_at = now
        self.frames += deltas + len(others)

    def _decoded(self, event: bytes, data: bytes, now: float) -> None:
        body: dict[str, Any] = json.loads(data) if data else {}
        if event == b"error":
            self.errors.append(f"{body.get('error')}: {body.get('message')}")
            return
        self.phase = body.get("phase")
        self.task_id = body.get("task_id", self.task_id)
        if self.phase == "started" and not self.started_at:
            self.started_at = now
        elif self.done:
            self.ended_at = now


@dataclass(slots=True)
class Frames:
    """Every frame of one SSE response with its receive time, decoded (for the
    low-volume scenarios — tool round trips, recovery — where each frame's time
    matters, not the rate)."""

    opened_at: float = 0.0
    frames: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    phase: str | None = None
    stop_reason: str | None = None
    task_id: str | None = None
    turn_id: str | None = None
    _parser: SSEParser = field(default_factory=lambda: SSEParser(every_frame=True), repr=False)

    @property
    def done(self) -> bool:
        return self.phase in ("completed", "errored")

    def feed(self, chunk: bytes, now: float) -> None:
        for raw_event, data in self._parser.feed(chunk)[1]:
            event = raw_event.decode()
            body: dict[str, Any] = json.loads(data) if data else {}
            self.frames.append((event, now, body))
            if event == "thread_lifecycle":
                self.phase = body.get("phase")
                self.stop_reason = body.get("stop_reason", self.stop_reason)

    def first(self, event: str, after: float = 0.0) -> tuple[float, dict[str, Any]] | None:
        for name, at, body in self.frames:
            if name == event and at > after:
                return at, body
        return None

    def types(self) -> list[str]:
        return [name for name, _, _ in self.frames]


class _Record(Protocol):
    """What :func:`_read` fills: :class:`SSECount` or :class:`Frames`."""

    opened_at: float
    task_id: str | None
    turn_id: str | None

    def feed(self, chunk: bytes, now: float) -> None: ...


_R = TypeVar("_R", bound=_Record)


async def _read(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    got: _R,
    stop: Callable[[], bool],
    *,
    key: str,
    json_body: dict[str, Any] | None,
    params: dict[str, Any] | None = None,
    record: list[bytes] | None = None,
) -> _R:
    """Feed one SSE response's chunks to ``got`` until ``stop()``."""
    got.opened_at = time.perf_counter()
    async with client.stream(
        method, url, headers={"X-Engine-Key": key}, json=json_body, params=params
    ) as response:
        if response.status_code != 200:
            body = await response.aread()
            raise StreamError(f"{method} {url}: HTTP {response.status_code}: {body[:300]!r}")
        got.task_id = response.headers.get("x-task-id", got.task_id)
        got.turn_id = response.headers.get("x-turn-id", got.turn_id)
        perf = time.perf_counter
        async for chunk in response.aiter_raw():
            got.feed(chunk, perf())
            if record is not None:
                record.append(chunk)
            if stop():
                break
    return got


async def stream(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    key: str,
    json_body: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
    stop_after_started: bool = False,
    record: list[bytes] | None = None,
    count: SSECount | None = None,
) -> SSECount:
    """Read one SSE response, counting, until its turn ends (or until ``started``).

    ``count`` may be passed in so a caller can watch progress (or cancel the
    read) while it runs; ``record`` collects the raw chunks.
    """
    got = count or SSECount()

    def stop() -> bool:
        return got.done or (stop_after_started and bool(got.started_at))

    return await _read(
        client, method, url, got, stop, key=key, json_body=json_body, params=params, record=record
    )


async def stream_frames(
    client: httpx.AsyncClient,
    method: str,
    url: str,
    *,
    key: str,
    json_body: dict[str, Any] | None = None,
    got: Frames | None = None,
) -> Frames:
    """Read one SSE response to the end of its turn, keeping every frame."""
    frames = got or Frames()
    return await _read(
        client, method, url, frames, lambda: frames.done, key=key, json_body=json_body
    )


def parse_rate(chunks: list[bytes], repeat: int = 20) -> tuple[float, int]:
    """Frames/s of :meth:`SSECount.feed` over recorded chunks, in memory (best of N)."""
    best = float("inf")
    frames = 0
    for _ in range(repeat):
        got = SSECount()
        start = time.perf_counter()
        for chunk in chunks:
            got.feed(chunk, 0.0)
        best = min(best, time.perf_counter() - start)
        frames = got.frames
    return (frames / best if best > 0 else float("inf")), frames
