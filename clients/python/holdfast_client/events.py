"""The events a turn streams, as typed models.

Every event is one flat JSON object on the wire: the envelope (``type``,
``task_id``, ``turn_id``, ``seq``, ``timestamp``) beside the type's own
fields. These models mirror the server's catalogue; they are written here,
not imported from it, so the client never depends on the server's packages.

An event type this client does not know yet (a newer server) parses as
:class:`UnknownEvent` with every field kept, never as an error: old clients
keep working when the engine learns to say more.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

BlockType = Literal["text", "thinking", "tool_use"]


class SubagentOrigin(BaseModel):
    """Where an event of a subagent's child task, mirrored into its parent's
    stream, comes from. ``task_id``, ``agent`` and ``depth`` name the task it was
    born in (a grandchild's keeps the grandchild's); ``tool_call_id`` is the
    parent's ``delegate`` call it came through, ``seq`` its seq in that call's
    child's log (absent on ``subagent_started``/``subagent_completed``)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    task_id: str
    agent: str
    depth: int
    tool_call_id: str
    seq: int | None = None


class BaseEvent(BaseModel):
    """The envelope every event carries; fields a newer server adds are kept."""

    model_config = ConfigDict(frozen=True, extra="allow")

    type: str
    task_id: str = ""
    turn_id: str | None = None
    # The event's place in the task's log, from 1; 0 only for heartbeats.
    seq: int = 0
    # Epoch milliseconds, strictly increasing per task.
    timestamp: int = 0
    # Set on a subagent's event in its parent's stream (its text is not the parent's).
    subagent: SubagentOrigin | None = None


class ThreadLifecycle(BaseEvent):
    """A turn started, or ended (``completed`` or ``errored``)."""

    type: Literal["thread_lifecycle"] = "thread_lifecycle"
    phase: Literal["started", "completed", "errored"]
    stop_reason: str | None = None
    # On a ``started`` that forked the conversation (an edit or a retry): the
    # fork, why, and the first turn that left the conversation with it.
    fork_id: str | None = None
    fork_reason: str | None = None
    fork_from_turn_id: str | None = None

    @property
    def ends_turn(self) -> bool:
        return self.phase in ("completed", "errored")


class ErrorEvent(BaseEvent):
    type: Literal["error"] = "error"
    error: str
    message: str
    details: dict[str, Any] | None = None


class TextDelta(BaseEvent):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseEvent):
    type: Literal["thinking_delta"] = "thinking_delta"
    text: str


class ContentBlockStart(BaseEvent):
    type: Literal["content_block_start"] = "content_block_start"
    block_index: int
    block_type: BlockType


class ContentBlockStop(BaseEvent):
    type: Literal["content_block_stop"] = "content_block_stop"
    block_index: int
    block_type: BlockType


class ToolCall(BaseEvent):
    type: Literal["tool_call"] = "tool_call"
    tool: str
    tool_call_id: str
    input: dict[str, Any]


class ToolResult(BaseEvent):
    type: Literal["tool_result"] = "tool_result"
    tool_call_id: str
    output: Any = None
    # Set only when the call failed (or was denied).
    error: str | None = None


class ToolProgress(BaseEvent):
    """A running tool call's progress, as its MCP server reported it: ``progress``
    so far, of ``total`` when known, with the server's ``message``."""

    type: Literal["tool_progress"] = "tool_progress"
    tool_call_id: str
    progress: float
    total: float | None = None
    message: str | None = None


class ToolOutcomeUnknown(BaseEvent):
    """Nobody knows whether an effectful tool call took effect: it was sent
    (``sent_at``, epoch ms) and no answer came (``runner_lost_at``: when its
    runner was found gone, or its time ran out; ``reason`` says which). The
    engine does not run it again by itself: a ``hitl_request`` of kind
    ``outcome_unknown`` follows, answered ``retry`` (run it again with the same
    ``idempotency_key``), ``succeeded`` or ``failed``; the model then sees one result.
    """

    type: Literal["tool_outcome_unknown"] = "tool_outcome_unknown"
    tool_call_id: str
    tool: str
    input: dict[str, Any]
    idempotency_key: str
    attempt: int = 1
    reason: str
    sent_at: int | None = None
    runner_lost_at: int | None = None


class HitlRequest(BaseEvent):
    """The turn waits for a person: a permission prompt for a tool call, or a question."""

    type: Literal["hitl_request"] = "hitl_request"
    request_id: str
    kind: Literal["permission", "question", "outcome_unknown", "elicitation"]
    question: str
    tool_call: dict[str, Any] | None = None
    # elicitation: the form an MCP server asks for (a flat JSON Schema object);
    # answer accept with content matching it, decline or cancel.
    requested_schema: dict[str, Any] | None = None
    expires_at: int | None = None


class HitlResolved(BaseEvent):
    type: Literal["hitl_resolved"] = "hitl_resolved"
    request_id: str
    answer: str | None = None


class WorkingMemoryUpdate(BaseEvent):
    """The agent changed its working memory: ``value`` is None for a deleted key."""

    type: Literal["working_memory_update"] = "working_memory_update"
    key: str
    value: Any = None


class CompactionEvent(BaseEvent):
    """The oldest turns were collapsed into a summary before a model call."""

    type: Literal["compaction_event"] = "compaction_event"
    summarized_messages: int
    summary_tokens: int | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None


class TurnResumed(BaseEvent):
    """The turn continues on another worker from its last snapshot; or, with
    ``reason`` ``"model_retry"``, a model call that broke off after output is
    made again.

    Events ``discard_from_seq``..``discard_to_seq`` (inclusive, when set) were
    the partial output of a step that was cut off and is run again: they were
    delivered already, and a client drops what it made of them.
    :class:`holdfast_client.TurnText` does that for the turn's text.
    """

    type: Literal["turn_resumed"] = "turn_resumed"
    reason: str
    discard_from_seq: int | None = None
    discard_to_seq: int | None = None

    def discards(self, seq: int) -> bool:
        """True when the event numbered ``seq`` is one this event takes back."""
        if self.discard_from_seq is None or self.discard_to_seq is None:
            return False
        return self.discard_from_seq <= seq <= self.discard_to_seq


class UserMessage(BaseEvent):
    """A message that joined the task while a turn ran (``on_busy="steer"``).

    ``applied`` is ``current_turn`` when the running turn took it in,
    ``next_turn`` when it started a turn of its own; ``message_id`` is what
    the ``POST /execute`` that sent it answered in ``X-Turn-Id``.
    """

    type: Literal["user_message"] = "user_message"
    text: str
    message_id: str
    steer: bool = True
    applied: Literal["current_turn", "next_turn"] = "current_turn"


class Heartbeat(BaseEvent):
    type: Literal["heartbeat"] = "heartbeat"


class Usage(BaseEvent):
    type: Literal["usage"] = "usage"
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    reasoning_tokens: int = 0
    model: str | None = None
    # The turn's active time so far (pauses and waits for a person excluded).
    active_seconds: float = 0.0
    # True when a model call of the turn reported no usage, or an implausible one
    # (a local server's constant), and was counted from the engine's estimates.
    estimated: bool | None = None
    # The subagents' usage so far, by child task name (each child counts its own).
    subagents: dict[str, dict[str, int]] | None = None


class Result(BaseEvent):
    """The turn's structured result (``output_schema``): the model's final answer
    as JSON, validated against the schema; logged just before ``completed``."""

    type: Literal["result"] = "result"
    # Any JSON value the schema allows; sent as null when it is null.
    result: Any
    # The model's answers it took (2: the first was invalid and corrected).
    attempts: int = 1


class Artifact(BaseEvent):
    """A file a tool call wrote under the workspace's ``outputs/``, after its
    ``tool_result``: ``download`` is its path on the API (``Client.download_file``
    takes the task and ``path``)."""

    type: Literal["artifact"] = "artifact"
    tool_call_id: str
    path: str
    name: str
    size: int
    sha256: str
    download: str


class SubagentStarted(BaseEvent):
    """The turn delegated to a subagent (``subagent`` names it and the call): the
    child's events follow, each with ``subagent`` set, until ``subagent_completed``."""

    type: Literal["subagent_started"] = "subagent_started"
    brief: str


class SubagentCompleted(BaseEvent):
    """The subagent's turn ended; its ``answer`` is the ``delegate`` call's result."""

    type: Literal["subagent_completed"] = "subagent_completed"
    status: str
    stop_reason: str | None = None
    answer: str = ""


class UnknownEvent(BaseEvent):
    """An event type this client does not know: its fields are in ``model_extra``."""


# Every event type this client knows, each by its ``type``.
_Known = (
    ThreadLifecycle
    | ErrorEvent
    | TextDelta
    | ThinkingDelta
    | ContentBlockStart
    | ContentBlockStop
    | ToolCall
    | ToolResult
    | ToolProgress
    | ToolOutcomeUnknown
    | HitlRequest
    | HitlResolved
    | WorkingMemoryUpdate
    | CompactionEvent
    | TurnResumed
    | UserMessage
    | Heartbeat
    | Usage
    | Result
    | Artifact
    | SubagentStarted
    | SubagentCompleted
)
KnownEvent = Annotated[_Known, Field(discriminator="type")]
Event = _Known | UnknownEvent

_KNOWN: TypeAdapter[KnownEvent] = TypeAdapter(KnownEvent)
_MODELS: dict[str, type[BaseEvent]] = {
    model.model_fields["type"].default: model
    for model in (
        ThreadLifecycle,
        ErrorEvent,
        TextDelta,
        ThinkingDelta,
        ContentBlockStart,
        ContentBlockStop,
        ToolCall,
        ToolResult,
        ToolProgress,
        ToolOutcomeUnknown,
        HitlRequest,
        HitlResolved,
        WorkingMemoryUpdate,
        CompactionEvent,
        TurnResumed,
        UserMessage,
        Heartbeat,
        Usage,
        Result,
        Artifact,
        SubagentStarted,
        SubagentCompleted,
    )
}
EVENT_TYPES = frozenset(_MODELS)
_VALIDATORS: dict[str, Any] = {
    name: model.__pydantic_validator__ for name, model in _MODELS.items()
}


def parse_event(data: str | bytes, event_type: str | None = None) -> Event:
    """One event's wire JSON as its typed model.

    ``event_type`` is the SSE frame's ``event:`` field, which the server sets
    to the event's type: with it the model is picked without a first parse.
    A type this client does not know becomes :class:`UnknownEvent`.
    """
    validator = _VALIDATORS.get(event_type) if event_type else None
    if validator is not None:
        # The model's own validator, as model_validate_json calls it, minus a
        # Python layer: this runs once per event.
        return cast(Event, validator.validate_json(data))
    raw = json.loads(data)
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ValueError("an event is a JSON object with a string 'type'")
    if raw["type"] in _MODELS:
        return _KNOWN.validate_python(raw)
    return UnknownEvent.model_validate(raw)
