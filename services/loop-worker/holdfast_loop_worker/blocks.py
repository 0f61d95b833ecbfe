"""Content blocks assembled from a provider's normalized stream.

The loop stores an assistant message as these blocks (the neutral format of
``holdfast_shared.conversation``); providers read them back on the next
call. One assembler, so the loop and the provider tests build them alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    ModelEvent,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
)


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


def assemble(events: Iterable[ModelEvent]) -> list[dict[str, Any]]:
    """The stored blocks of one model call's events."""
    blocks: dict[int, Block] = {}
    for event in events:
        if isinstance(event, BlockStart):
            blocks[event.index] = Block.opened(event)
        elif isinstance(event, TextChunk | ThinkingChunk | ToolInputChunk):
            blocks[event.index].add(event)
        elif isinstance(event, BlockStop):
            blocks[event.index].close(event)
    return [blocks[i].to_content() for i in sorted(blocks)]
