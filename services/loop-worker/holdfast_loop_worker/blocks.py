"""Content blocks assembled from a provider's normalized stream.

The loop stores an assistant message as these blocks (the neutral format of
``holdfast_shared.conversation``); providers read them back on the next
call. One dispatcher (:class:`StreamBlocks`), driven by the loop's model step
(``turn/model_step.py``) and by :func:`assemble` (the provider tests), so both
build blocks alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from holdfast_shared.events import (
    ContentBlockStart,
    ContentBlockStop,
    TextDelta,
    ThinkingDelta,
    ToolCall,
)
from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
)

# What the client sees of a model call's blocks.
BlockEvent = ContentBlockStart | ContentBlockStop | TextDelta | ThinkingDelta | ToolCall


@dataclass
class Block:
    block_type: str
    text: str = ""
    signature: str | None = None
    redacted: str | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    partial_json: list[str] = field(default_factory=list)
    closed: bool = False

    @classmethod
    def opened(cls, start: BlockStart) -> Block:
        return cls(start.block_type, tool_name=start.tool_name, tool_call_id=start.tool_call_id)

    def add(self, chunk: TextChunk | ThinkingChunk | ToolInputChunk) -> None:
        if isinstance(chunk, ToolInputChunk):
            self.partial_json.append(chunk.partial_json)
        else:
            self.text += chunk.text

    def close(self, stop: BlockStop | None) -> None:
        self.closed = True
        if stop is not None:
            self.signature = stop.signature
            self.redacted = stop.redacted

    def tool_input(self) -> dict[str, Any]:
        raw = "".join(self.partial_json)
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return {"_unparsed": raw}
        return value if isinstance(value, dict) else {"value": value}

    def to_content(self) -> dict[str, Any]:
        if self.block_type == "tool_use":
            call: dict[str, Any] = {
                "type": "tool_use",
                "id": self.tool_call_id,
                "name": self.tool_name,
                "input": self.tool_input(),
            }
            if self.signature:  # Gemini signs function calls and wants them back
                call["signature"] = self.signature
            return call
        block: dict[str, Any] = {"type": self.block_type, "text": self.text}
        if self.signature:
            block["signature"] = self.signature
        if self.redacted is not None:
            block["redacted"] = self.redacted
        return block


class StreamBlocks:
    """One model call's blocks, built event by event; each event says what the
    client is shown of it. No I/O: the model step emits what :meth:`take` returns."""

    def __init__(self) -> None:
        self.by_index: dict[int, Block] = {}
        self.stop_reason = "end_turn"

    def take(self, event: ModelEvent) -> list[BlockEvent]:
        """Add one provider event; the events the client sees for it."""
        blocks = self.by_index
        if isinstance(event, TextChunk):
            blocks[event.index].add(event)
            return [TextDelta(text=event.text)]
        if isinstance(event, ThinkingChunk):
            blocks[event.index].add(event)
            return [ThinkingDelta(text=event.text)]
        if isinstance(event, ToolInputChunk):
            blocks[event.index].add(event)
            return []
        if isinstance(event, BlockStart):
            blocks[event.index] = Block.opened(event)
            return [ContentBlockStart(block_index=event.index, block_type=event.block_type)]
        if isinstance(event, BlockStop):
            return self._close(event.index, event, announce_tool=True)
        if isinstance(event, Finish):
            self.stop_reason = event.stop_reason
        return []

    def close_open(self) -> list[BlockEvent]:
        """Close what a cut-off call left open, so the client's view is whole. A
        tool call cut off is not announced: it will not run."""
        closing: list[BlockEvent] = []
        for index in sorted(self.by_index):
            if not self.by_index[index].closed:
                closing += self._close(index, None, announce_tool=False)
        return closing

    def blocks(self) -> list[Block]:
        return [self.by_index[i] for i in sorted(self.by_index)]

    def contents(self) -> list[dict[str, Any]]:
        return [block.to_content() for block in self.blocks()]

    def _close(
        self, index: int, stop: BlockStop | None, *, announce_tool: bool
    ) -> list[BlockEvent]:
        closed = self.by_index[index]
        closed.close(stop)
        shown: list[BlockEvent] = [
            ContentBlockStop(block_index=index, block_type=closed.block_type)
        ]
        if closed.block_type == "tool_use" and announce_tool:
            shown.append(
                ToolCall(
                    tool=closed.tool_name or "",
                    tool_call_id=closed.tool_call_id or "",
                    input=closed.tool_input(),
                )
            )
        return shown


def assemble(events: Iterable[ModelEvent]) -> list[dict[str, Any]]:
    """The stored blocks of one model call's events."""
    dispatcher = StreamBlocks()
    for event in events:
        dispatcher.take(event)
    return dispatcher.contents()
