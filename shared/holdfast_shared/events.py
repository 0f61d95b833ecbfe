"""The SSE event catalogue: one typed model per event type, one union, one adapter.

On the wire every event is one flat JSON object: the envelope (``type``,
``task_id``, ``turn_id``, ``seq``, ``timestamp``) beside the type's own
fields. Producers build a model without envelope values; the event log
assigns ``seq`` and ``timestamp`` when it appends (see ``eventlog``), so the
body they serialise is :func:`body_json` and never carries them.

This module is the only reader and writer of event JSON: the rest of the
engine asks it which turn an event belongs to (:func:`turn_of`) and whether
it ends that turn (:func:`ends_turn`) instead of matching substrings.
``working_memory_update`` and ``compaction_event`` are emitted by the context
engine (prompt assembly and compaction).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

ENVELOPE_FIELDS = frozenset({"task_id", "turn_id", "seq", "timestamp"})

BlockType = Literal["text", "thinking", "tool_use"]
TERMINAL_PHASES = frozenset({"completed", "errored"})


class SubagentOrigin(BaseModel):
    """Where a mirrored event comes from: a child task the turn delegated to.

    ``task_id``, ``agent`` and ``depth`` (1: a child of the task a client
    started, 2: its child, ...) are the task the event was born in: a
    grandchild's event mirrored through its parent keeps the grandchild's.
    ``tool_call_id`` is the ``delegate`` call of this turn it came through
    and ``seq`` its seq in that call's child's log (absent on
    ``subagent_started`` and ``subagent_completed``). A mirrored event's own
    ``seq`` is the parent's: a client following the parent resumes from it.
    """

    model_config = ConfigDict(frozen=True)

    task_id: str
    agent: str
    depth: int
    tool_call_id: str
    seq: int | None = None


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")

    # Fields sent as null when None; every other None field is left out.
    KEEP_NULL: ClassVar[frozenset[str]] = frozenset()

    # Each event type narrows this to its Literal (the union's discriminator).
    type: str
    task_id: str = ""
    turn_id: str | None = None
    # Unset (0) only for heartbeats, which are not part of the log.
    seq: int = 0
    # Epoch milliseconds, strictly increasing per task.
    timestamp: int = 0
    # Set on a child task's event mirrored into its parent's log (subagents).
    subagent: SubagentOrigin | None = None


class ThreadLifecycle(_Event):
    """A turn starts or ends.

    A ``started`` whose turn forked the conversation (``POST /execute`` with
    ``edit_message_id`` or ``retry_message_id``) names the fork:
    ``fork_id``, ``fork_reason`` (``edit`` | ``retry``) and
    ``fork_from_turn_id``, the first turn that left the conversation — it
    and every later turn before this one are no longer part of it (their
    events stay in the log; ``GET /tasks/{task_id}/messages?branch=all``
    shows their messages).
    """

    type: Literal["thread_lifecycle"] = "thread_lifecycle"
    phase: Literal["started", "completed", "errored"]
    stop_reason: str | None = None
    fork_id: str | None = None
    fork_reason: str | None = None
    fork_from_turn_id: str | None = None


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    error: str
    message: str
    details: dict[str, Any] | None = None


class TextDelta(_Event):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(_Event):
    type: Literal["thinking_delta"] = "thinking_delta"
    text: str


class ContentBlockStart(_Event):
    type: Literal["content_block_start"] = "content_block_start"
    block_index: int
    block_type: BlockType


class ContentBlockStop(_Event):
    type: Literal["content_block_stop"] = "content_block_stop"
    block_index: int
    block_type: BlockType


class ToolCall(_Event):
    type: Literal["tool_call"] = "tool_call"
    tool: str
    tool_call_id: str
    input: dict[str, Any]


class ToolResult(_Event):
    type: Literal["tool_result"] = "tool_result"
    tool_call_id: str
    # Absent when the call failed (``error`` says why): body_json omits a null.
    output: Any = None
    error: str | None = None


class Artifact(_Event):
    """A file a tool call wrote under the workspace's ``outputs/``: the agent's
    output for the client, after the call's ``tool_result``. ``download`` is its
    path on the API (``GET /tasks/{task_id}/files/{path}``)."""

    type: Literal["artifact"] = "artifact"
    tool_call_id: str
    path: str
    name: str
    size: int
    sha256: str
    download: str


class ToolProgress(_Event):
    """A running tool call's progress, as its MCP server reported it
    (``notifications/progress``): ``progress`` so far, of ``total`` when the server
    knows it, and its ``message``. Between the call's ``tool_call`` and its
    ``tool_result``; sent at most a few times a second (the last report of a
    burst may be skipped, never one that reaches ``total``)."""

    type: Literal["tool_progress"] = "tool_progress"
    tool_call_id: str
    progress: float
    total: float | None = None
    message: str | None = None


class ToolOutcomeUnknown(_Event):
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


class HitlRequest(_Event):
    type: Literal["hitl_request"] = "hitl_request"
    request_id: str
    kind: Literal["permission", "question", "outcome_unknown", "elicitation"]
    question: str
    tool_call: dict[str, Any] | None = None
    # elicitation: the form an MCP server asks for (a flat JSON Schema object);
    # answer accept with content matching it, decline or cancel.
    requested_schema: dict[str, Any] | None = None
    expires_at: int | None = None


class HitlResolved(_Event):
    type: Literal["hitl_resolved"] = "hitl_resolved"
    request_id: str
    answer: str | None = None


class WorkingMemoryUpdate(_Event):
    """The agent changed its working memory: ``value`` is null for a deleted key."""

    KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"value"})

    type: Literal["working_memory_update"] = "working_memory_update"
    key: str
    value: Any = None


class CompactionEvent(_Event):
    """The oldest turns were collapsed into a summary before a model call.

    ``summarized_messages`` stored messages (and the summary before, if any)
    became one summary of ``summary_tokens``; the context went from
    ``tokens_before`` to ``tokens_after`` (estimated, in the provider's units).
    The messages stay in the log and the database; only the model's view is
    shorter.
    """

    type: Literal["compaction_event"] = "compaction_event"
    summarized_messages: int
    summary_tokens: int | None = None
    tokens_before: int | None = None
    tokens_after: int | None = None


class TurnResumed(_Event):
    """The turn continues on another worker (or after a restart) from its last
    snapshot; or, ``reason: "model_retry"``, a model call whose stream broke
    off after output is made again on the same worker.

    Events ``discard_from_seq``..``discard_to_seq`` (when present) were the
    partial output of a step that was cut off and is now run again: a client
    drops them (e.g. the text deltas of an interrupted model call) and shows
    what follows instead.
    """

    type: Literal["turn_resumed"] = "turn_resumed"
    reason: str
    discard_from_seq: int | None = None
    discard_to_seq: int | None = None


class UserMessage(_Event):
    """A user's message that joined the task while a turn ran (``on_busy: "steer"``).

    ``applied`` is ``current_turn`` when the running turn took it in at an
    iteration boundary (the model's next call sees it), ``next_turn`` when
    that turn ended first and the message started a turn of its own (logged
    right after that turn's ``started``). ``message_id`` is the id the
    ``POST /execute`` that sent it answered in ``X-Turn-Id``.
    """

    type: Literal["user_message"] = "user_message"
    text: str
    message_id: str
    steer: bool = True
    applied: Literal["current_turn", "next_turn"] = "current_turn"


class Heartbeat(_Event):
    type: Literal["heartbeat"] = "heartbeat"


# The token counts a ``usage`` event (and a turn's usage totals) carry.
USAGE_COUNTS: tuple[str, ...] = (
    "input_tokens",
    "output_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "reasoning_tokens",
)


class Usage(_Event):
    type: Literal["usage"] = "usage"
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    reasoning_tokens: int = 0
    model: str | None = None
    # The turn's active time so far (pauses and waits for a human excluded).
    active_seconds: float = 0.0
    # True when a model call of the turn reported no usage, or an implausible one
    # (a local server's constant), and was counted from the engine's estimates.
    estimated: bool | None = None
    # The subagents' usage so far (not in the counts above: each child task
    # counts its own), by child task name (a grandchild's too).
    subagents: dict[str, dict[str, int]] | None = None


class Result(_Event):
    """A turn's structured result (``output_schema`` on /execute or /v1/execution):
    the model's final answer parsed as JSON and validated against the schema,
    logged just before the turn's ``completed``. A result that stays invalid
    ends the turn ``errored`` with ``OUTPUT_INVALID`` instead."""

    type: Literal["result"] = "result"
    # A null result (a schema may allow one) is sent as null, not left out.
    KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"result"})
    # Any JSON value the schema allows (an object, most often).
    result: Any
    # The model's answers it took (2: the first was invalid and corrected).
    attempts: int = 1


class SubagentStarted(_Event):
    """The turn delegated to a child task (the ``delegate`` tool's call
    ``subagent.tool_call_id``): its events follow, each with ``subagent`` set,
    until ``subagent_completed``. The child is a task of its own
    (``GET /tasks/{subagent.task_id}``)."""

    type: Literal["subagent_started"] = "subagent_started"
    brief: str


class SubagentCompleted(_Event):
    """The child task's turn ended: ``status`` (``completed``, ``errored``,
    ``cancelled``) and its answer, which is the ``delegate`` call's result."""

    type: Literal["subagent_completed"] = "subagent_completed"
    status: str
    stop_reason: str | None = None
    answer: str = ""


Event = Annotated[
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
    | SubagentCompleted,
    Field(discriminator="type"),
]

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_MODELS: tuple[type[_Event], ...] = get_args(get_args(Event)[0])
EVENT_TYPES = frozenset(model.model_fields["type"].default for model in EVENT_MODELS)


def parse_event(data: str | bytes) -> Event:
    """Parse one event's wire JSON into its typed model."""
    return EVENT_ADAPTER.validate_json(data)


def body_json(event: _Event) -> str:
    """The event's own fields (``type`` first) as JSON, without the envelope.

    Optional fields left unset are omitted, so ``error`` appears on a
    ``tool_result`` only when the call failed — but for the type's
    ``KEEP_NULL`` fields, whose null says something (a deleted key).
    """
    body = event.model_dump_json(exclude=set(ENVELOPE_FIELDS), exclude_none=True)
    missing = [name for name in sorted(event.KEEP_NULL) if getattr(event, name) is None]
    if not missing:
        return body
    nulls = ",".join(f'"{name}":null' for name in missing)
    return f"{body[:-1]},{nulls}}}"


def envelope_json(task_id: str, turn_id: str | None, seq: int, timestamp: int, body: str) -> str:
    """Join envelope and body into the flat wire JSON.

    Ids are restricted to a JSON-safe alphabet (see ``ids``), so they need no
    escaping. The event log's append script (``eventlog/lua/append.lua``) builds
    every stored envelope, in the step that assigns its seq and timestamp; this is
    its twin for a caller that has both from the append's answer (the gateway's
    first frame of a turn), and the tests' oracle that the two agree.
    """
    turn = "null" if turn_id is None else f'"{turn_id}"'
    return (
        f'{{"task_id":"{task_id}","turn_id":{turn},"seq":{seq},"timestamp":{timestamp},' + body[1:]
    )


def heartbeat_json(task_id: str, timestamp: int) -> str:
    """A heartbeat's wire JSON: not logged, so no seq and no turn."""
    return Heartbeat(task_id=task_id, timestamp=timestamp).model_dump_json(
        include={"type", "task_id", "timestamp"}
    )


def turn_of(data: str) -> str | None:
    """The ``turn_id`` of a logged event's wire JSON, without parsing it all.

    The envelope is written in a fixed order (:func:`envelope_json` and the
    event log's append script) and ids need no escaping, so the turn id sits
    at a known place: this runs for every event archived or replayed.
    """
    # The first match is the envelope's: the task id before it holds no quote.
    marker = '","turn_id":'
    start = data.find(marker)
    if start < 0 or data.startswith("null", start + len(marker)):
        return None
    start += len(marker) + 1
    return data[start : data.index('"', start)]


def ends_turn(event_type: str, data: str, turn_id: str | None = None) -> bool:
    """True for the ``thread_lifecycle`` event that ends a turn (``turn_id``'s,
    when given)."""
    if event_type != "thread_lifecycle":
        return False
    if turn_id is not None and turn_of(data) != turn_id:
        return False
    event = parse_event(data)
    return isinstance(event, ThreadLifecycle) and event.phase in TERMINAL_PHASES
