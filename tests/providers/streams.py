"""What every provider test needs: a conversation, a tool, and ways to read a stream."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers.base import ModelEvent, ProviderError, ToolSpec

SYSTEM = "You are Holdfast's test agent."
WEATHER = ToolSpec(
    name="get_weather",
    description="Current weather for a city.",
    input_schema={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"],
    },
)
CLOCK = ToolSpec(name="get_time", description="", input_schema={"type": "object", "properties": {}})


def user(text: str) -> ChatMessage:
    return ChatMessage(role="user", blocks=({"type": "text", "text": text},))


async def collect(stream: AsyncIterator[ModelEvent]) -> list[ModelEvent]:
    return [event async for event in stream]


async def collect_until_error(
    stream: AsyncIterator[ModelEvent],
) -> tuple[list[ModelEvent], ProviderError]:
    """The events before the stream failed, and the failure."""
    events: list[ModelEvent] = []
    with pytest.raises(ProviderError) as caught:
        async for event in stream:
            events.append(event)
    return events, caught.value
