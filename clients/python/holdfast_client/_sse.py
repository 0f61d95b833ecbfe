"""Server-Sent Events frames from a response's bytes, a frame at a time per blank line.

httpx-sse decodes line by line through several Python layers, which costs
more per event than the rest of the client together; this decoder splits
whole chunks at once with ``str`` methods (C speed) and looks at a frame's
few lines only. It follows the SSE parsing rules: ``\\r\\n``, ``\\r`` and
``\\n`` end lines, a blank line ends a frame, ``:`` starts a comment, one
space after the colon is dropped, several ``data`` lines join with ``\\n``.
"""

from __future__ import annotations

import codecs
import re


class Frame:
    """One SSE frame: what httpx-sse's ``Frame`` holds, in plain slots
    (read several times per event on the client's hot path)."""

    __slots__ = ("data", "event", "id", "retry")

    def __init__(self, event: str, data: str, id: str | None, retry: int | None) -> None:
        self.event = event
        self.data = data
        self.id = id
        self.retry = retry

    def __repr__(self) -> str:
        return f"Frame({self.event!r}, {self.data!r}, {self.id!r}, {self.retry!r})"


class FrameDecoder:
    """Feed it a response's chunks in order; it returns the frames each completes."""

    __slots__ = ("_tail", "_utf8")

    def __init__(self) -> None:
        self._tail = ""
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, chunk: bytes) -> list[Frame]:
        text = self._tail + self._utf8.decode(chunk)
        # A final \r may be the first half of \r\n: wait for the next chunk.
        held = ""
        if text.endswith("\r"):
            text, held = text[:-1], "\r"
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        frames = text.split("\n\n")
        self._tail = frames.pop() + held
        return [event for block in frames if (event := _frame(block)) is not None]


# The engine's own shape of a frame (event, id, one data line), matched in one
# call; anything else takes the general path.
_ENGINE_FRAME = re.compile(r"event: ([^\n]+)\nid: ([^\n\0]*)\ndata: ([^\n]*)")


def _frame(block: str) -> Frame | None:
    fast = _ENGINE_FRAME.fullmatch(block)
    if fast is not None:
        event, last_id, data = fast.groups()
        return Frame(event, data, last_id, None)
    return _general_frame(block.split("\n"))


def _general_frame(lines: list[str]) -> Frame | None:
    event = ""
    data: list[str] = []
    last_id: str | None = None
    retry: int | None = None
    for line in lines:
        if not line or line[0] == ":":
            continue
        name, _, value = line.partition(":")
        if value[:1] == " ":
            value = value[1:]
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id":
            if "\0" not in value:
                last_id = value
        elif name == "retry" and value.isdigit():
            retry = int(value)
    if not data and retry is None:
        return None
    return Frame(event or "message", "\n".join(data), last_id, retry)
