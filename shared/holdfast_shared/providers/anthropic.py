"""The ``anthropic`` provider: the Messages API stream, normalized.

Consumes a :class:`ModelRequest`; sends one ``POST /v1/messages`` with
``stream: true`` through the official SDK's async client and produces the
normalized stream of ``base.py`` from the raw SSE events (``message_start``,
``content_block_start/delta/stop``, ``message_delta``, ``message_stop``;
``ping`` is skipped by the SDK, ``event: error`` raised by it).

What it guarantees:

* Block indexes are our own 0, 1, 2…: block types we do not model (server
  tool blocks) are skipped, so the API's indexes could leave gaps.
* A thinking block's signature (``signature_delta``) arrives on its
  :class:`BlockStop`; a ``redacted_thinking`` block is a thinking block with
  no text whose opaque data rides on ``BlockStop.redacted``. Both are sent
  back verbatim on later requests, as the API requires during tool use.
* Exactly one :class:`UsageReport`, then :class:`Finish`, after
  ``message_stop``. Anthropic's counts pass through as they are:
  ``input_tokens`` excludes both cache reads and cache writes (the three sum
  to the prompt). ``message_delta`` counts are cumulative, so they overwrite.
* Stop reasons: ``end_turn``, ``stop_sequence``, ``max_tokens``, ``tool_use``
  as they are; ``model_context_window_exceeded`` → ``max_tokens`` (output cut
  by a length limit); ``pause_turn`` and ``refusal`` → ``end_turn`` (the
  model stopped and there is no tool to run; ``refusal`` keeps its
  ``stop_details``). The raw value is in ``Finish.extra["raw_stop_reason"]``.
* Every failure is a :class:`ProviderError` — HTTP errors, ``event: error``
  inside a 200 stream, connections dropped mid-stream, and a stream that
  ends without ``message_stop``. The SDK's own retries are off
  (``max_retries=0``): ``stream_with_retries`` owns retrying.
* Prompt caching, arranged: the body goes out as ``model``, ``max_tokens``,
  ``stream``, ``thinking``, ``tools``, ``system``, ``messages`` — what changes
  least first, as the API renders the prompt (tools, system, messages). The
  SDK's ``messages.create`` would put ``messages`` second whatever the order
  of its arguments, so the body is built here and sent with the SDK's own
  ``post`` (same client, headers, errors and SSE decoding). At most four
  ``cache_control`` breakpoints: the last tool, the system prompt, the soul
  (its own system block, when there is one) and the newest message's last
  block before the notes, which go last as a text block of their own — so
  the next call, whose history extends this one's, reads this one's cache.
* Media (``holdfast_shared.media_support``): images as ``image`` blocks (base64 or
  URL source), PDFs as ``document`` blocks (base64 or URL), ``text/plain`` as
  a ``document`` with a text source; before the message's text. Anything
  else fails the call as ``UNSUPPORTED_MEDIA`` before a byte is sent.
* Tool calls and results go out paired (``toolpairs.paired``).
* Structured output (``output_schema``, ``structured.py``) by tool-forcing:
  one more tool, ``final_result``, whose input schema is the output schema
  (wrapped in an object as ``result`` when its root is not one), and
  ``tool_choice`` ``any`` (``tool`` when it is the only tool; ``auto`` with
  extended thinking, which refuses forcing). Its call comes out as a text
  block holding its input JSON (a wrapped one unwrapped, whole at the
  block's end), and a response whose only call it was finishes ``end_turn``:
  to the loop it is the answer, not a tool to run.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import anthropic
import httpx2
from anthropic.types import (
    Message,
    MessageParam,
    RawMessageStreamEvent,
    TextBlockParam,
    ThinkingConfigParam,
    ToolParam,
)

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.errors import ErrorCode
from holdfast_shared.media_support import IMAGES, PDF, PLAIN_TEXT
from holdfast_shared.providers import media, structured
from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    BlockType,
    Finish,
    ModelEvent,
    ModelRequest,
    ProviderError,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    UsageReport,
    malformed_stream,
)
from holdfast_shared.providers.toolpairs import paired
from holdfast_shared.providers.waits import retry_after

API_KEY_ENV = "ANTHROPIC_API_KEY"
BASE_URL_ENV = "ANTHROPIC_BASE_URL"
THINKING_BUDGET_ENV = "HOLDFAST_ANTHROPIC_THINKING_BUDGET"

# The API rejects smaller thinking budgets.
MIN_THINKING_BUDGET = 1024

_STOP_REASONS = {
    "end_turn": "end_turn",
    "stop_sequence": "stop_sequence",
    "max_tokens": "max_tokens",
    "tool_use": "tool_use",
    "model_context_window_exceeded": "max_tokens",
    "pause_turn": "end_turn",
    "refusal": "end_turn",
}

# Error types as they appear in an error body, for errors that arrive inside
# a 200 stream (no HTTP status of their own): the status they would have had.
_TYPE_STATUS = {
    "invalid_request_error": 400,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}

# 429s that no wait fixes: the organisation's spend cap, not a rate.
_SPEND_LIMIT_CODES = frozenset(
    {
        "enforced_spend_limit_reached",
        "contract_spend_limit_reached",
        "linked_organization_spend_limit_reached",
    }
)

_CONTEXT_OVERFLOW = re.compile(
    r"prompt is too long|exceed context limit|context window|context length", re.IGNORECASE
)


class AnthropicProvider:
    name = "anthropic"

    def __init__(
        self, *, api_key: str, base_url: str | None = None, thinking_budget: int | None = None
    ) -> None:
        if thinking_budget is not None and thinking_budget < MIN_THINKING_BUDGET:
            raise ValueError(f"thinking_budget must be at least {MIN_THINKING_BUDGET}")
        self._thinking_budget = thinking_budget
        self._client = anthropic.AsyncAnthropic(api_key=api_key, base_url=base_url, max_retries=0)

    async def aclose(self) -> None:
        await self._client.close()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        """One model call as normalized events; failures raise :class:`ProviderError`."""
        media.require_supported(self.name, request)
        thinking: ThinkingConfigParam | None = None
        max_tokens = request.max_tokens
        if self._thinking_budget is not None:
            thinking = {"type": "enabled", "budget_tokens": self._thinking_budget}
            # The API counts thinking inside max_tokens (and wants the budget
            # below it); adding it keeps the answer's own allowance intact.
            max_tokens += self._thinking_budget
        body = to_body(request, max_tokens=max_tokens, thinking=thinking)
        schema = structured.wanted(request)
        translator = _Translator(
            unwrap=schema is not None and not structured.is_object_schema(schema)
        )
        try:
            raw = await self._client.post(
                "/v1/messages",
                body=body,
                cast_to=Message,
                stream=True,
                stream_cls=anthropic.AsyncStream[RawMessageStreamEvent],
            )
            async with raw:
                async for event in raw:
                    for normalized in translator.feed(event):
                        yield normalized
        except anthropic.APIStatusError as exc:
            raise _status_error(exc) from exc
        except anthropic.APIConnectionError as exc:
            raise _connection_error(exc) from exc
        except httpx2.TransportError as exc:
            # The SDK wraps transport errors while connecting, not while
            # reading the body: a reset mid-stream arrives as httpx2's own.
            raise _connection_error(exc) from exc
        except json.JSONDecodeError as exc:  # the SDK decodes each data field as is
            raise malformed_stream(self.name, exc) from exc
        if not translator.finished:
            raise ProviderError(
                ErrorCode.LLM_PROVIDER_ERROR,
                "the Anthropic stream ended before message_stop",
                retryable=True,
            )


def from_env(environ: Mapping[str, str]) -> AnthropicProvider | None:
    """A configured provider when ``ANTHROPIC_API_KEY`` is set, else None."""
    api_key = environ.get(API_KEY_ENV)
    if not api_key:
        return None
    budget = environ.get(THINKING_BUDGET_ENV)
    return AnthropicProvider(
        api_key=api_key,
        base_url=environ.get(BASE_URL_ENV) or None,
        thinking_budget=int(budget) if budget else None,
    )


# --- request: neutral values → the Messages API's shapes -----------------


def to_body(
    request: ModelRequest, *, max_tokens: int, thinking: ThinkingConfigParam | None = None
) -> dict[str, Any]:
    """The JSON body of one call, in the order the prompt is cached: stable parts first."""
    body: dict[str, Any] = {"model": request.model, "max_tokens": max_tokens, "stream": True}
    if thinking is not None:
        body["thinking"] = thinking
    schema = structured.wanted(request)
    if tools := _tools(request, schema):
        body["tools"] = tools
    if schema is not None:
        body["tool_choice"] = _tool_choice(request, thinking)
    if system := _system(request):
        body["system"] = system
    body["messages"] = to_messages(request.messages, notes=request.notes)
    return body


def _system(request: ModelRequest) -> list[TextBlockParam]:
    # Blocks rather than a string so each part has its breakpoint: the system
    # prompt (the same for every task of an agent), then the soul (the same
    # for every turn of a user's task).
    return [
        {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}
        for text in (request.system, request.soul)
        if text
    ]


def _tools(request: ModelRequest, schema: dict[str, Any] | None = None) -> list[ToolParam]:
    tools: list[ToolParam] = []
    for spec in request.tools:
        tool: ToolParam = {"name": spec.name, "input_schema": spec.input_schema}
        if spec.description:
            tool["description"] = spec.description
        tools.append(tool)
    if schema is not None:
        tools.append(
            {
                "name": structured.OUTPUT_TOOL,
                "description": structured.OUTPUT_TOOL_DESCRIPTION,
                "input_schema": structured.tool_input_schema(schema),
            }
        )
    if tools:
        # Tools render before the system prompt, so this breakpoint caches them.
        tools[-1]["cache_control"] = {"type": "ephemeral"}
    return tools


def _tool_choice(request: ModelRequest, thinking: ThinkingConfigParam | None) -> dict[str, Any]:
    """Force a tool call, so the turn ends by calling the output tool: ``tool``
    when it is the only one, ``any`` when the agent has others to call first.
    Extended thinking refuses forcing: ``auto``, and the answer is validated
    as any other (a prose answer is asked again once)."""
    if thinking is not None:
        return {"type": "auto"}
    if not request.tools:
        return {"type": "tool", "name": structured.OUTPUT_TOOL}
    return {"type": "any"}


def to_messages(messages: Iterable[ChatMessage], *, notes: str = "") -> list[MessageParam]:
    """The conversation in the Messages API's format, the newest message marked for the cache.

    Tool calls are paired with their results first (``toolpairs``).
    Consecutive messages of one role merge (the API alternates roles), tool
    results lead their user message (the API wants them first), media follow
    them, before the text, and blocks the API would reject are dropped: empty
    text, and thinking without a signature (another provider's, which
    Anthropic cannot verify). The newest message's last cacheable block
    carries a breakpoint; ``notes`` follow it as a text block of their own.
    """
    out: list[dict[str, Any]] = []
    for message in paired(messages):
        role = "assistant" if message.role == "assistant" else "user"
        blocks = [b for b in map(_block, message.blocks) if b is not None]
        if role == "user":
            blocks = [*blocks, *map(_media_block, message.media)]
        if not blocks:
            continue
        if out and out[-1]["role"] == role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": role, "content": blocks})
    for rendered in out:
        if rendered["role"] == "user":
            # A stable sort: results first, then media, then text, each in order.
            rendered["content"].sort(key=_user_rank)
    _mark_newest(out)
    if notes:
        if not out or out[-1]["role"] != "user":
            out.append({"role": "user", "content": []})
        out[-1]["content"].append({"type": "text", "text": notes})
    # Plain dicts built to the SDK's TypedDict shapes; the SDK sends them as JSON.
    return cast("list[MessageParam]", out)


def _user_rank(block: dict[str, Any]) -> int:
    kind = block["type"]
    return 0 if kind == "tool_result" else 1 if kind in ("image", "document") else 2


# Thinking blocks cannot carry a breakpoint; any other block can.
_UNCACHEABLE = frozenset({"thinking", "redacted_thinking"})


def _mark_newest(messages: list[dict[str, Any]]) -> None:
    if not messages:
        return
    for block in reversed(messages[-1]["content"]):
        if block["type"] not in _UNCACHEABLE:
            block["cache_control"] = {"type": "ephemeral"}
            return


def _media_block(item: Mapping[str, Any]) -> dict[str, Any]:
    kind = media.media_type(item)
    linked = media.is_linked(item)
    if kind in IMAGES:
        source: dict[str, Any] = (
            {"type": "url", "url": item["url"]}
            if linked
            else {"type": "base64", "media_type": kind, "data": item["data"]}
        )
        return {"type": "image", "source": source}
    if kind == PDF:
        source = (
            {"type": "url", "url": item["url"]}
            if linked
            else {"type": "base64", "media_type": kind, "data": item["data"]}
        )
    elif kind == PLAIN_TEXT and not linked:
        source = {"type": "text", "media_type": kind, "data": media.decoded_text(item)}
    else:  # refused by require_supported before rendering
        raise ProviderError(ErrorCode.UNSUPPORTED_MEDIA, f"anthropic cannot take {kind} media")
    document: dict[str, Any] = {"type": "document", "source": source}
    if item.get("name"):
        document["title"] = item["name"]
    return document


def _block(block: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block["text"]} if block.get("text") else None
    if kind == "thinking":
        if block.get("redacted"):
            return {"type": "redacted_thinking", "data": block["redacted"]}
        if block.get("signature"):
            return {
                "type": "thinking",
                "thinking": block.get("text", ""),
                "signature": block["signature"],
            }
        return None
    if kind == "tool_use":
        return {
            "type": "tool_use",
            "id": block["id"],
            "name": block["name"],
            "input": block.get("input") or {},
        }
    if kind == "tool_result":
        return _tool_result(block)
    return None


def _tool_result(block: Mapping[str, Any]) -> dict[str, Any]:
    output = block.get("output")
    text = output if isinstance(output, str) else "" if output is None else json.dumps(output)
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": block["tool_use_id"]}
    error = block.get("error")
    if error:
        result["is_error"] = True
        text = f"{text}\n{error}" if text else str(error)
    if text:
        result["content"] = text
    return result


# --- response: raw stream events → normalized events ---------------------


@dataclass
class _Open:
    index: int
    block_type: BlockType
    signature: list[str] = field(default_factory=list)
    redacted: str | None = None
    # The output tool's call, shown as a text block; its input JSON is held
    # here until the block ends when it must be unwrapped.
    held: list[str] | None = None


@dataclass
class _Translator:
    """State of one stream: open blocks, usage so far, the stop reason."""

    # The output schema was wrapped (structured.tool_input_schema): the answer
    # is the output tool's ``result`` property.
    unwrap: bool = False
    blocks: dict[int, _Open] = field(default_factory=dict)
    # Calls of tools the loop runs (the output tool's is not one).
    tool_calls: int = 0
    next_index: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    stop_reason: str | None = None
    stop_extra: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    def feed(self, event: RawMessageStreamEvent) -> list[ModelEvent]:
        # Dispatch on the ``type`` strings, not classes: the SDK builds
        # unknown event and block types leniently into some known class.
        if event.type == "message_start":
            self._count(event.message.usage)
        elif event.type == "content_block_start":
            return self._start(event.index, event.content_block)
        elif event.type == "content_block_delta":
            return self._delta(event.index, event.delta)
        elif event.type == "content_block_stop":
            return self._stop(event.index)
        elif event.type == "message_delta":
            self._count(event.usage)
            self.stop_reason = event.delta.stop_reason
            if event.delta.stop_sequence is not None:
                self.stop_extra["stop_sequence"] = event.delta.stop_sequence
            if event.delta.stop_details is not None:
                self.stop_extra["stop_details"] = event.delta.stop_details.to_dict()
        elif event.type == "message_stop":
            self.finished = True
            return [self._usage_report(), self._finish()]
        return []

    def _start(self, api_index: int, content: Any) -> list[ModelEvent]:
        kind = content.type
        if kind not in ("text", "thinking", "redacted_thinking", "tool_use"):
            return []
        block_type: BlockType = "thinking" if kind == "redacted_thinking" else kind
        opened = _Open(self.next_index, block_type)
        self.blocks[api_index] = opened
        self.next_index += 1
        i = opened.index
        if kind == "tool_use" and content.name == structured.OUTPUT_TOOL:
            return self._start_answer(opened, content.input)
        if kind == "tool_use":
            self.tool_calls += 1
            out: list[ModelEvent] = [BlockStart(i, "tool_use", content.name, content.id)]
            if content.input:  # streamed input starts as {}; anything else is final
                out.append(ToolInputChunk(i, json.dumps(content.input)))
            return out
        out = [BlockStart(i, block_type)]
        if kind == "redacted_thinking":
            opened.redacted = content.data
        elif kind == "thinking" and content.thinking:
            out.append(ThinkingChunk(i, content.thinking))
        elif kind == "text" and content.text:
            out.append(TextChunk(i, content.text))
        return out

    def _start_answer(self, opened: _Open, given: Any) -> list[ModelEvent]:
        """The output tool's call opens a text block: its input is the answer."""
        opened.block_type = "text"
        text = json.dumps(given) if given else ""  # streamed input starts as {}
        if self.unwrap:
            opened.held = [text]
            return [BlockStart(opened.index, "text")]
        out: list[ModelEvent] = [BlockStart(opened.index, "text")]
        if text:
            out.append(TextChunk(opened.index, text))
        return out

    def _delta(self, api_index: int, delta: Any) -> list[ModelEvent]:
        opened = self.blocks.get(api_index)
        if opened is None:
            return []
        i = opened.index
        kind = delta.type
        if opened.held is not None and kind == "input_json_delta":
            opened.held.append(delta.partial_json)
            return []
        if opened.block_type == "text" and kind == "input_json_delta" and delta.partial_json:
            return [TextChunk(i, delta.partial_json)]
        if kind == "text_delta" and delta.text:
            return [TextChunk(i, delta.text)]
        if kind == "thinking_delta" and delta.thinking:
            return [ThinkingChunk(i, delta.thinking)]
        if kind == "input_json_delta" and delta.partial_json:
            return [ToolInputChunk(i, delta.partial_json)]
        if kind == "signature_delta":
            opened.signature.append(delta.signature)
        return []

    def _stop(self, api_index: int) -> list[ModelEvent]:
        opened = self.blocks.pop(api_index, None)
        if opened is None:
            return []
        if opened.redacted is not None:
            return [BlockStop(opened.index, redacted=opened.redacted)]
        if opened.held is not None:
            return [*_unwrapped(opened.index, "".join(opened.held)), BlockStop(opened.index)]
        return [BlockStop(opened.index, "".join(opened.signature) or None)]

    def _count(self, usage: Any) -> None:
        for name in (
            "input_tokens",
            "output_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens",
        ):
            value = getattr(usage, name, None)
            if value is not None:
                self.usage[name] = value
        details = getattr(usage, "output_tokens_details", None)
        if details is not None and details.thinking_tokens is not None:
            self.usage["reasoning_tokens"] = details.thinking_tokens

    def _usage_report(self) -> UsageReport:
        return UsageReport(**self.usage)

    def _finish(self) -> Finish:
        raw = self.stop_reason or "end_turn"
        stop_reason = _STOP_REASONS.get(raw, "end_turn")
        if stop_reason == "tool_use" and not self.tool_calls:
            stop_reason = "end_turn"  # it only called the output tool: it answered
        return Finish(stop_reason, {"raw_stop_reason": raw, **self.stop_extra})


def _unwrapped(index: int, raw: str) -> list[ModelEvent]:
    """The answer inside a wrapped output tool's input (its ``result``), as
    text; the input as it came when it is not the wrapper (the loop-worker's
    validation then says what is wrong with it)."""
    try:
        given = json.loads(raw or "{}")
    except json.JSONDecodeError:
        return [TextChunk(index, raw)] if raw else []
    if isinstance(given, dict) and structured.WRAPPED_PROPERTY in given:
        return [TextChunk(index, json.dumps(given[structured.WRAPPED_PROPERTY]))]
    return [TextChunk(index, raw)] if raw else []


# --- errors: SDK exceptions → ProviderError ------------------------------


def _status_error(exc: anthropic.APIStatusError) -> ProviderError:
    error_type = exc.type
    in_stream = exc.status_code < 400  # ``event: error`` inside a 200 stream
    status = _TYPE_STATUS.get(error_type or "", 500) if in_stream else exc.status_code
    message = exc.api_message or exc.message
    details: dict[str, Any] = {"provider": "anthropic", "error_type": error_type}
    if exc.request_id:
        details["request_id"] = exc.request_id
    if exc.error_code:
        details["error_code"] = exc.error_code
    if in_stream:
        details["in_stream"] = True
    if status == 429:
        return ProviderError(
            ErrorCode.LLM_RATE_LIMITED,
            f"Anthropic rate limit: {message}",
            details=details,
            retryable=exc.error_code not in _SPEND_LIMIT_CODES,
            retry_after=None if in_stream else retry_after(exc.response.headers),
            status=status,
        )
    if status in (400, 413) and _CONTEXT_OVERFLOW.search(message):
        return ProviderError(
            ErrorCode.CONTEXT_OVERFLOW, message, details=details, retryable=False, status=status
        )
    return ProviderError(
        ErrorCode.LLM_PROVIDER_ERROR,
        f"Anthropic error {status}: {message}",
        details=details,
        retryable=status in (408, 409) or status >= 500,
        retry_after=None if in_stream else retry_after(exc.response.headers),
        status=status,
    )


def _connection_error(exc: Exception) -> ProviderError:
    timed_out = isinstance(exc, anthropic.APITimeoutError | httpx2.TimeoutException)
    kind = "timed out" if timed_out else "connection failed"
    return ProviderError(
        ErrorCode.LLM_PROVIDER_ERROR,
        f"Anthropic {kind}: {type(exc).__name__}: {exc}",
        details={"provider": "anthropic"},
        retryable=True,
    )
