"""A minimal, fast SSE client for the bench: httpx raw chunks + a frame counter.

The parser counts frames by their ``event:`` line; it decodes the JSON of
``thread_lifecycle``, ``error`` and ``heartbeat`` frames (a handful per turn)
and nothing else, so the client costs a small fraction of a microsecond per
``text_delta`` frame. ``bench.run`` checks that claim each run by re-feeding
a recorded stream.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

_DELTA_LINE = b"event: text_delta"
_HEARTBEAT = b"heartbeat"
# A frame whose event is not text_delta: its event name and its (one) data line.
_OTHER_FRAME = re.compile(
    rb"event:(?! ?text_delta\r?\n) ?([^\r\n]*)\r?\n(?:id:[^\r\n]*\r?\n)?(?:data: ?([^\r\n]*))?"
)
_DECODED = frozenset({b"thread_lifecycle", b"error"})


class StreamError(RuntimeError):
    pass


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
    _buf: bytes = b""

    @property
    def done(self) -> bool:
        return self.phase in ("completed", "errored")

    def feed(self, chunk: bytes, now: float) -> None:
        """Consume one network chunk received at ``now``.

        Only complete frames (up to the last blank line) are looked at; the rest
        waits for the next chunk. ``text_delta`` frames are counted with
        ``bytes.count`` (C speed); the few other frames are picked out with a
        regular expression and their ``data`` decoded.
        """
        self.chunks += 1
        if not self.first_chunk_at:
            self.first_chunk_at = now
        buf = self._buf + chunk if self._buf else chunk
        crlf = buf.rfind(b"\r\n\r\n")
        lf = buf.rfind(b"\n\n")
        end = max(crlf + 4 if crlf >= 0 else 0, lf + 2 if lf >= 0 else 0)
        if not end:
            self._buf = buf
            return
        if end == len(buf):
            region, self._buf = buf, b""
        else:
            region, self._buf = buf[:end], buf[end:]
        deltas = region.count(_DELTA_LINE)
        frames = deltas
        if region.count(b"event:") != deltas:
            for match in _OTHER_FRAME.finditer(region):
                frames += 1
                event, data = match.group(1), match.group(2)
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
        self.frames += frames

    def _decoded(self, event: bytes, data: bytes | None, now: float) -> None:
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
    """Read one SSE response until its turn ends (or until ``started``).

    ``count`` may be passed in so a caller can watch progress (or cancel the
    read) while it runs; ``record`` collects the raw chunks.
    """
    got = count or SSECount()
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
            if got.done or (stop_after_started and got.started_at):
                break
    return got


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
    _buf: bytes = b""

    @property
    def done(self) -> bool:
        return self.phase in ("completed", "errored")

    def feed(self, chunk: bytes, now: float) -> None:
        buf = (self._buf + chunk).replace(b"\r\n", b"\n")
        *complete, self._buf = buf.split(b"\n\n")
        for raw in complete:
            event, data = "message", b""
            for line in raw.split(b"\n"):
                if line.startswith(b"event:"):
                    event = line[6:].strip().decode()
                elif line.startswith(b"data:"):
                    data = line[5:].strip()
            if not raw.strip():
                continue
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
    got = got or Frames()
    got.opened_at = time.perf_counter()
    headers = {"X-Engine-Key": key}
    async with client.stream(method, url, headers=headers, json=json_body) as response:
        if response.status_code != 200:
            body = await response.aread()
            raise StreamError(f"{method} {url}: HTTP {response.status_code}: {body[:300]!r}")
        got.task_id = response.headers.get("x-task-id")
        got.turn_id = response.headers.get("x-turn-id")
        perf = time.perf_counter
        async for chunk in response.aiter_raw():
            got.feed(chunk, perf())
            if got.done:
                break
    return got
