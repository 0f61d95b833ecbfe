"""The provider interface: one normalized stream whatever the model.

A provider turns a :class:`ModelRequest` into an async stream of
:data:`ModelEvent` values. Blocks are opened, filled by chunks and closed;
a turn-level :class:`Finish` carries the stop reason. The loop maps these to
SSE events, so every provider looks the same to a client.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.errors import ErrorCode, HoldfastError
from holdfast_shared.tools import ToolSpec as ToolSpec  # re-exported for providers

BlockType = Literal["text", "thinking", "tool_use"]


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One model call, in the context engine's sections (see ``context/``).

    Providers render it so that what changes least comes first and a cache
    can hold it (``tools``, ``system``, ``soul``, then ``messages`` oldest
    first), and what changes every call comes last: ``notes`` — working
    memory and retrieved memory — go after the last message's own content,
    and a cache breakpoint on the newest message sits *before* them, so the
    next call, whose history extends this one's, reads this call's cache.
    """

    model: str
    # The agent's system prompt: the same for every call of a task.
    system: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[ToolSpec, ...] = ()
    max_tokens: int = 4096
    # The soul (and other long-lived memory): stable across turns, its own
    # system block with its own cache breakpoint.
    soul: str = ""
    # Working memory and retrieved memory, rendered: appended to the last
    # (user-role) message as a text block of its own.
    notes: str = ""
    # Stable per task, for providers that route prompt caches by a key
    # (OpenAI's prompt_cache_key).
    cache_key: str | None = None
    # "turn": a step of the agent's turn; "summary": the context engine's
    # compaction call (no tools, nothing streamed to the client);
    # "extraction": the learning centre reading a trajectory (one tool to call);
    # "skill": a prompt-only skill doing its work for the agent (the skill
    # tool's sub-call: no tools, its answer is the tool's result).
    purpose: Literal["turn", "summary", "extraction", "skill"] = "turn"
    # A JSON Schema the final answer must meet (``output_schema`` on /execute):
    # each provider asks for it natively and gives the answer as the call's
    # text (``structured.py``). Only ``turn`` calls ask.
    output_schema: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class BlockStart:
    index: int
    block_type: BlockType
    tool_name: str | None = None
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class TextChunk:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ThinkingChunk:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolInputChunk:
    index: int
    partial_json: str


@dataclass(frozen=True, slots=True)
class BlockStop:
    index: int
    # Set for thinking blocks whose provider signs them (sent back verbatim).
    signature: str | None = None
    # Opaque data of a redacted thinking block (Anthropic), sent back verbatim.
    redacted: str | None = None


@dataclass(frozen=True, slots=True)
class UsageReport:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    reasoning_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Finish:
    stop_reason: str
    extra: dict[str, Any] = field(default_factory=dict)


ModelEvent = (
    BlockStart | TextChunk | ThinkingChunk | ToolInputChunk | BlockStop | UsageReport | Finish
)


class Provider(Protocol):
    """A model backend. ``name`` is the ``provider`` part of ``provider:model``."""

    name: str

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]: ...


class ProviderError(HoldfastError):
    """A model call failed. ``code`` is a stable ErrorCode value.

    ``retryable`` marks failures worth another attempt (429, 5xx, overloaded,
    connection reset); ``retry_after`` carries the server's ``retry-after``
    in seconds when it sent one.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        details: dict[str, Any] | None = None,
        retryable: bool = False,
        retry_after: float | None = None,
        status: int | None = None,
    ):
        super().__init__(code, message, details)
        self.retryable = retryable
        self.retry_after = retry_after
        self.status = status


def malformed_stream(provider: str, exc: Exception) -> ProviderError:
    """An event the SDK could not read (not JSON, not an SSE line): retried, as
    a corrupted transfer or a server's slip most likely does not repeat."""
    return ProviderError(
        ErrorCode.LLM_PROVIDER_ERROR,
        f"malformed event in the {provider} stream: {exc}",
        details={"provider": provider, "malformed": True},
        retryable=True,
    )
