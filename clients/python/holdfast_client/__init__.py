"""Holdfast's Python client: typed events, a turn stream that resumes itself, the HTTP API.

    from holdfast_client import Client

    with Client("http://127.0.0.1:8000", key="hf_...") as client:
        turn = client.stream("hello")
        for event in turn:
            ...
        print(turn.transcript.text)

See README.md next to this package for the whole API.
"""

from holdfast_client._api import PendingRequest
from holdfast_client._resume import Reconnect
from holdfast_client.client import AsyncClient, AsyncTurnStream, Client, TurnStream, default_key
from holdfast_client.errors import HoldfastError
from holdfast_client.events import (
    Artifact,
    BaseEvent,
    CompactionEvent,
    ContentBlockStart,
    ContentBlockStop,
    ErrorEvent,
    Event,
    Heartbeat,
    HitlRequest,
    HitlResolved,
    Result,
    SubagentCompleted,
    SubagentOrigin,
    SubagentStarted,
    TextDelta,
    ThinkingDelta,
    ThreadLifecycle,
    ToolCall,
    ToolOutcomeUnknown,
    ToolProgress,
    ToolResult,
    TurnResumed,
    UnknownEvent,
    Usage,
    UserMessage,
    WorkingMemoryUpdate,
    parse_event,
)
from holdfast_client.text import TurnText

__all__ = [
    "Artifact",
    "AsyncClient",
    "AsyncTurnStream",
    "BaseEvent",
    "Client",
    "CompactionEvent",
    "ContentBlockStart",
    "ContentBlockStop",
    "ErrorEvent",
    "Event",
    "Heartbeat",
    "HitlRequest",
    "HitlResolved",
    "HoldfastError",
    "PendingRequest",
    "Reconnect",
    "Result",
    "SubagentCompleted",
    "SubagentOrigin",
    "SubagentStarted",
    "TextDelta",
    "ThinkingDelta",
    "ThreadLifecycle",
    "ToolCall",
    "ToolOutcomeUnknown",
    "ToolProgress",
    "ToolResult",
    "TurnResumed",
    "TurnStream",
    "TurnText",
    "UnknownEvent",
    "Usage",
    "UserMessage",
    "WorkingMemoryUpdate",
    "default_key",
    "parse_event",
]
