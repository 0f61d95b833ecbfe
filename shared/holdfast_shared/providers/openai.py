"""The ``openai`` provider: Chat Completions streaming through the official SDK.

Chat Completions is the protocol OpenAI-compatible servers speak (vLLM,
Ollama, llama.cpp, LM Studio), so this one provider covers the hosted API and
local models alike.

What it sends: the system prompt, then the soul, as the first ``system``
message; user text; assistant text with its ``tool_calls``; every
``tool_result`` block as its own ``{"role": "tool", "tool_call_id",
"content"}`` message (a failed call's content starts with ``ERROR:``), tool
calls and results paired first (``toolpairs.paired``); tools as
``{"type": "function"}`` entries; ``stream_options.include_usage`` so the
last chunk carries the token counts. Thinking blocks are not sent back: Chat
Completions has no field for them. The output limit goes out as
``max_completion_tokens`` to api.openai.com (its reasoning models refuse the
deprecated ``max_tokens``) and as ``max_tokens`` to any other base URL
(Ollama and LM Studio only read that one).

Text-only content always goes as a string, never a list of parts: the chat
templates of llama.cpp's server (llama-cpp-python's formats) drop list
content. Templates that drop the system message (llama-cpp-python's
``gemma``) get it folded into the first user message instead, for the models
``HOLDFAST_OPENAI_SYSTEM_AS_USER`` names (fnmatch patterns, comma-separated,
case-insensitive; default ``*gemma*``; empty: none).

Media (``holdfast_shared.media_support``) go before the text of their user message,
which then has content parts: images as ``image_url`` parts (the URL, or a
``data:`` URI), PDFs as ``file`` parts (``file_data`` as a ``data:`` URI with
the ``filename``; base64 only, Chat Completions fetches no file URL), wav/mp3
as ``input_audio`` parts (audio models only). Anything else fails the call as
``UNSUPPORTED_MEDIA`` before a byte is sent.

Prompt caching: OpenAI caches the longest prefix it has seen, routed by
``prompt_cache_key`` — the task's ``cache_key``. The body goes out with what
changes least first (settings, ``tools``, then ``messages``, the system
message leading them) and ``notes`` last, appended to the text of the last
user message (its last text part when it has media), or a user message of
their own after tool messages. The SDK's
``chat.completions.create`` would put ``messages`` before ``tools`` whatever
the order of its arguments, so the body is built here and sent with the
SDK's own ``post`` (same client, auth, errors and SSE decoding).

Structured output (``output_schema``, ``structured.py``): the turn's own
calls carry ``response_format`` ``{"type": "json_schema", "json_schema":
{"name": "result", "schema": ..., "strict": false}}``; the answer is the
content, JSON.

What it reads: ``delta.reasoning_content`` or ``delta.reasoning`` (vLLM,
DeepSeek, Ollama) as a thinking block, ``delta.content`` as text,
``delta.tool_calls[i]`` as one tool_use block per call, the choice's
``finish_reason`` and the usage chunk. Errors become :class:`ProviderError`
(see :func:`provider_error`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal
from urllib.parse import urlsplit

from openai import (
    APIConnectionError,
    APIError,
    APIStatusError,
    AsyncOpenAI,
    AsyncStream,
    OpenAIError,
)
from openai.types import CompletionUsage
from openai.types.chat import (
    ChatCompletion,
    ChatCompletionAssistantMessageParam,
    ChatCompletionChunk,
    ChatCompletionContentPartParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessageFunctionToolCallParam,
    ChatCompletionMessageParam,
    ChatCompletionUserMessageParam,
)
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.errors import ErrorCode
from holdfast_shared.media_support import IMAGES, OPENAI_AUDIO_FORMATS, PDF
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
    ToolSpec,
    UsageReport,
    malformed_stream,
)
from holdfast_shared.providers.toolpairs import paired
from holdfast_shared.providers.waits import retry_after

API_KEY_ENV = "OPENAI_API_KEY"
BASE_URL_ENV = "OPENAI_BASE_URL"
SYSTEM_AS_USER_ENV = "HOLDFAST_OPENAI_SYSTEM_AS_USER"
DEFAULT_SYSTEM_AS_USER = "*gemma*"
# Local servers ignore the key, but the SDK refuses to build a client without one.
LOCAL_PLACEHOLDER_KEY = "unused"

MaxTokensParam = Literal["max_completion_tokens", "max_tokens"]


def from_env(environ: Mapping[str, str]) -> OpenAIProvider | None:
    """An :class:`OpenAIProvider` configured from the environment, or None.

    ``OPENAI_API_KEY`` enables the provider (against api.openai.com unless
    ``OPENAI_BASE_URL`` points elsewhere). ``OPENAI_BASE_URL`` alone also
    enables it, with the placeholder key ``unused``, so a local
    OpenAI-compatible server that needs no key (Ollama:
    ``OPENAI_BASE_URL=http://localhost:11434/v1``) works with nothing else
    set. Empty values count as unset.
    """
    api_key = environ.get(API_KEY_ENV) or None
    base_url = environ.get(BASE_URL_ENV) or None
    if api_key is None and base_url is None:
        return None
    return OpenAIProvider(
        api_key=api_key or LOCAL_PLACEHOLDER_KEY,
        base_url=base_url,
        system_as_user=system_as_user_patterns(
            environ.get(SYSTEM_AS_USER_ENV, DEFAULT_SYSTEM_AS_USER)
        ),
    )


def system_as_user_patterns(value: str) -> tuple[str, ...]:
    """``HOLDFAST_OPENAI_SYSTEM_AS_USER``'s patterns (comma-separated, lower-cased)."""
    return tuple(p.strip().lower() for p in value.split(",") if p.strip())


def folds_system(model: str, patterns: Iterable[str]) -> bool:
    """Whether ``model``'s system prompt goes into its first user message."""
    name = model.lower()
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def default_max_tokens_param(base_url: str | None) -> MaxTokensParam:
    """``max_completion_tokens`` for OpenAI itself, ``max_tokens`` for anything else."""
    if base_url is None or urlsplit(base_url).hostname == "api.openai.com":
        return "max_completion_tokens"
    return "max_tokens"


class OpenAIProvider:
    name = "openai"

    def __init__(
        self,
        *,
        api_key: str,
        base_url: str | None = None,
        max_tokens_param: MaxTokensParam | None = None,
        system_as_user: tuple[str, ...] = (),
    ) -> None:
        # max_retries=0: retries belong to stream_with_retries, which knows
        # whether output was already emitted. base_url None leaves the SDK's
        # default (its own OPENAI_BASE_URL lookup, then api.openai.com).
        self._client = AsyncOpenAI(api_key=api_key, base_url=base_url, max_retries=0)
        # Decided on the URL the SDK resolved, which may come from its own env lookup.
        resolved = str(self._client.base_url)
        self._max_tokens_param = max_tokens_param or default_max_tokens_param(resolved)
        self._system_as_user = system_as_user

    @property
    def endpoint(self) -> str | None:
        """The self-hosted server this provider calls, whose calls compete for
        it (``holdfast_shared.endpoint_calls``); None for OpenAI's own API."""
        url = str(self._client.base_url)
        if urlsplit(url).hostname == "api.openai.com":
            return None
        return f"{self.name} {url}"

    async def aclose(self) -> None:
        """Release the SDK client's connection pool."""
        await self._client.close()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        media.require_supported(self.name, request)
        body = to_body(
            request,
            self._max_tokens_param,
            system_as_user=folds_system(request.model, self._system_as_user),
        )
        translator = _Translator()
        try:
            chunks = await self._client.post(
                "/chat/completions",
                body=body,
                cast_to=ChatCompletion,
                stream=True,
                stream_cls=AsyncStream[ChatCompletionChunk],
                # What chat.completions.create asks for: the API key as a bearer token.
                options={"security": {"bearer_auth": True}},
            )
            async with chunks:  # closes the response if the consumer stops early
                async for chunk in chunks:
                    for event in translator.feed(chunk):
                        yield event
        except OpenAIError as exc:
            raise provider_error(exc) from exc
        except json.JSONDecodeError as exc:
            raise malformed_stream(self.name, exc) from exc
        for event in translator.finish():
            yield event


# --- request translation ---------------------------------------------------


def to_tools(specs: Iterable[ToolSpec]) -> list[ChatCompletionFunctionToolParam]:
    return [
        {
            "type": "function",
            "function": {
                "name": spec.name,
                "description": spec.description,
                "parameters": spec.input_schema,
            },
        }
        for spec in specs
    ]


def to_body(
    request: ModelRequest, limit: MaxTokensParam, *, system_as_user: bool = False
) -> dict[str, Any]:
    """The JSON body of one call, in the order the prompt is cached: stable parts first."""
    body: dict[str, Any] = {
        "model": request.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        limit: request.max_tokens,
    }
    if request.cache_key:
        body["prompt_cache_key"] = request.cache_key
    if request.tools:
        body["tools"] = to_tools(request.tools)
    if (schema := structured.wanted(request)) is not None:
        body["response_format"] = response_format(schema)
    body["messages"] = to_messages(request, system_as_user=system_as_user)
    return body


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    """Structured output (``output_schema``): the answer is JSON for ``schema``.

    Not ``strict``: strict mode takes only a subset of JSON Schema (every
    property required, ``additionalProperties: false``), and a user's schema
    need not be in it; the loop-worker validates the answer either way."""
    return {
        "type": "json_schema",
        "json_schema": {"name": structured.SCHEMA_NAME, "schema": schema, "strict": False},
    }


def to_messages(
    request: ModelRequest, *, system_as_user: bool = False
) -> list[ChatCompletionMessageParam]:
    """The messages of one call; ``system_as_user``: the system prompt opens the
    first user message instead (for chat templates that drop system messages)."""
    messages: list[ChatCompletionMessageParam] = []
    system = "\n\n".join(text for text in (request.system, request.soul) if text)
    if system and not system_as_user:
        messages.append({"role": "system", "content": system})
    for message in paired(request.messages):
        if message.role == "assistant":
            assistant = _assistant_message(message.blocks)
            if assistant is not None:
                messages.append(assistant)
        else:
            messages.extend(_user_messages(message))
    if request.notes:
        _add_text(messages, request.notes, first=False)
    if system and system_as_user:
        _add_text(messages, system, first=True)
    return messages


def _add_text(messages: list[ChatCompletionMessageParam], text: str, *, first: bool) -> None:
    """``text`` after the text of the last user message (``first``: before the
    text of the first one), or as a user message of its own where there is
    none (after tool messages: Chat Completions takes a user message there).
    A string stays a string: llama.cpp's chat templates drop list content."""
    users = [m for m in messages if m["role"] == "user"]
    if not users or (not first and messages[-1] is not users[-1]):
        own: ChatCompletionUserMessageParam = {"role": "user", "content": text}
        messages.insert(0 if first else len(messages), own)
        return
    target = users[0] if first else users[-1]
    content = target["content"]
    if isinstance(content, str):
        target["content"] = _joined(text, content, first=first)
        return
    parts = list(content)
    texts = [i for i, part in enumerate(parts) if part["type"] == "text"]
    if not texts:
        parts.append({"type": "text", "text": text})
    else:
        at = texts[0] if first else texts[-1]
        part = parts[at]
        if part["type"] == "text":
            parts[at] = {"type": "text", "text": _joined(text, part["text"], first=first)}
    target["content"] = parts


def _joined(text: str, content: str, *, first: bool) -> str:
    return f"{text}\n\n{content}" if first else f"{content}\n\n{text}"


def _assistant_message(
    blocks: Iterable[dict[str, Any]],
) -> ChatCompletionAssistantMessageParam | None:
    text = ""
    calls: list[ChatCompletionMessageFunctionToolCallParam] = []
    for block in blocks:
        if block.get("type") == "text":
            text += block.get("text", "")
        elif block.get("type") == "tool_use":
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
    if not text and not calls:
        return None  # e.g. only thinking: nothing Chat Completions can carry
    message: ChatCompletionAssistantMessageParam = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(message: ChatMessage) -> list[ChatCompletionMessageParam]:
    # Tool results go first: the API wants each tool call answered by a
    # ``tool`` message directly after the assistant message that made it.
    messages: list[ChatCompletionMessageParam] = []
    text = ""
    for block in message.blocks:
        if block.get("type") == "tool_result":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": block["tool_use_id"],
                    "content": tool_result_content(block),
                }
            )
        elif block.get("type") == "text":
            text += block.get("text", "")
    if message.media:
        parts = [_media_part(item) for item in message.media]
        if text:
            parts.append({"type": "text", "text": text})
        messages.append({"role": "user", "content": parts})
    elif text:
        messages.append({"role": "user", "content": text})
    return messages


def _media_part(item: Mapping[str, Any]) -> ChatCompletionContentPartParam:
    kind = media.media_type(item)
    linked = media.is_linked(item)
    if kind in IMAGES:
        url = str(item["url"]) if linked else media.data_uri(item)
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == PDF and not linked:
        filename = str(item.get("name") or "document.pdf")
        return {"type": "file", "file": {"filename": filename, "file_data": media.data_uri(item)}}
    audio = OPENAI_AUDIO_FORMATS.get(kind)
    if audio is not None and not linked:
        return {"type": "input_audio", "input_audio": {"data": str(item["data"]), "format": audio}}
    # Refused by require_supported before rendering.
    raise ProviderError(ErrorCode.UNSUPPORTED_MEDIA, f"openai cannot take {kind} media")


def tool_result_content(block: Mapping[str, Any]) -> str:
    """A tool message's text: the output, after an ``ERROR:`` line when the call failed."""
    output = block.get("output")
    if output is None:
        text = ""
    elif isinstance(output, str):
        text = output
    else:
        text = json.dumps(output, ensure_ascii=False, default=str)
    error = block.get("error")
    if not error:
        return text
    reason = error if isinstance(error, str) else "the tool call failed"
    return f"ERROR: {reason}" + (f"\n{text}" if text else "")


# --- stream translation ----------------------------------------------------

_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "end_turn",
}
# vLLM renamed reasoning_content to reasoning and, for a while, sends both with
# the same text; the first one present wins so nothing is shown twice.
_REASONING_FIELDS = ("reasoning_content", "reasoning")


@dataclass
class _ToolCall:
    """One streamed tool call; a block once its name is known."""

    call_id: str | None = None
    name: str | None = None
    block: int | None = None
    closed: bool = False
    pending: list[str] = field(default_factory=list)
    streamed: bool = False


class _Translator:
    """Turns chunks into normalized events, one open block at a time.

    A delta for another kind of block (or another tool call) closes the open
    block; providers stream blocks one after another, so this keeps the
    BlockStart/chunks/BlockStop order of the contract.
    """

    def __init__(self) -> None:
        self._next_index = 0
        self._open: tuple[int, BlockType] | None = None
        self._open_call: _ToolCall | None = None
        self._calls: dict[int, _ToolCall] = {}
        self._all_calls: list[_ToolCall] = []
        self._finish_reason: str | None = None
        self._usage: CompletionUsage | None = None
        self._refusal = False

    def feed(self, chunk: ChatCompletionChunk) -> list[ModelEvent]:
        events: list[ModelEvent] = []
        if chunk.usage is not None:
            self._usage = chunk.usage
        for choice in chunk.choices:
            if choice.index != 0:
                continue  # we never ask for n > 1
            delta = choice.delta
            reasoning = _reasoning_text(delta)
            if reasoning:
                events.append(ThinkingChunk(self._enter("thinking", events), reasoning))
            if delta.content:
                events.append(TextChunk(self._enter("text", events), delta.content))
            if delta.refusal:
                self._refusal = True
                events.append(TextChunk(self._enter("text", events), delta.refusal))
            for fragment in delta.tool_calls or ():
                self._tool_fragment(fragment, events)
            if choice.finish_reason:
                self._finish_reason = choice.finish_reason
        return events

    def finish(self) -> list[ModelEvent]:
        if self._finish_reason is None and self._next_index == 0 and self._usage is None:
            # Nothing at all after HTTP 200: how llama-cpp-python's server ends
            # a prompt over its window (the error only in its log). Taken for an
            # overflow, marked as a guess: the context engine compacts and
            # tries again when the prompt was big (context/budget.py).
            raise ProviderError(
                ErrorCode.CONTEXT_OVERFLOW,
                "the model stream ended without any output or finish_reason "
                "(a prompt over the model's context window, as llama.cpp's server ends it?)",
                details={"provider": "openai", "suspected_overflow": True},
                retryable=False,
            )
        if self._finish_reason is None:
            # The body ended cleanly but early (a proxy cut it, or the server
            # died after flushing): not a finished answer.
            raise ProviderError(
                ErrorCode.LLM_PROVIDER_ERROR,
                "the model stream ended without a finish_reason",
                retryable=True,
            )
        if any(call.block is None for call in self._all_calls):
            raise ProviderError(ErrorCode.LLM_PROVIDER_ERROR, "a streamed tool call had no name")
        events: list[ModelEvent] = []
        self._close(events)
        events.append(usage_report(self._usage))
        events.append(self._finish_event(self._finish_reason))
        return events

    def _finish_event(self, raw: str) -> Finish:
        stop_reason = _STOP_REASONS.get(raw, "end_turn")
        extra: dict[str, Any] = {"raw_stop_reason": raw}
        if raw == "stop" and self._all_calls:
            # Some compatible servers (older Ollama) say "stop" after tool calls.
            stop_reason = "tool_use"
        if raw == "content_filter":
            extra["content_filter"] = True
        if self._refusal:
            extra["refusal"] = True
        if self._usage is None:
            extra["usage_reported"] = False
        return Finish(stop_reason, extra)

    def _enter(self, block_type: Literal["text", "thinking"], events: list[ModelEvent]) -> int:
        """The index of the open text/thinking block, opening one if needed."""
        if self._open is not None and self._open[1] == block_type:
            return self._open[0]
        self._close(events)
        index = self._next_index
        self._next_index += 1
        self._open = (index, block_type)
        events.append(BlockStart(index, block_type))
        return index

    def _close(self, events: list[ModelEvent]) -> None:
        if self._open is None:
            return
        index, _ = self._open
        call = self._open_call
        if call is not None:
            if not call.streamed:
                # An argument-less call still has a JSON input: the empty object.
                events.append(ToolInputChunk(index, "{}"))
            call.closed = True
            self._open_call = None
        events.append(BlockStop(index))
        self._open = None

    def _tool_fragment(self, fragment: ChoiceDeltaToolCall, events: list[ModelEvent]) -> None:
        function = fragment.function
        name = function.name if function else None
        arguments = function.arguments if function else None
        call = self._calls.get(fragment.index)
        if call is None or (fragment.id and name and call.call_id and fragment.id != call.call_id):
            # A new call; Ollama sends parallel calls all at index 0, told apart by id.
            call = _ToolCall()
            self._calls[fragment.index] = call
            self._all_calls.append(call)
        call.call_id = call.call_id or fragment.id
        call.name = call.name or name
        if arguments:
            if call.closed:
                raise ProviderError(
                    ErrorCode.LLM_PROVIDER_ERROR,
                    "tool call arguments arrived after another block had started",
                )
            call.pending.append(arguments)
        if call.block is None and call.name:
            self._close(events)
            index = self._next_index
            self._next_index += 1
            call.block = index
            call.call_id = call.call_id or f"call_{uuid.uuid4().hex[:24]}"
            self._open = (index, "tool_use")
            self._open_call = call
            events.append(BlockStart(index, "tool_use", call.name, call.call_id))
        if call is self._open_call and call.block is not None and call.pending:
            events.extend(ToolInputChunk(call.block, part) for part in call.pending)
            call.pending.clear()
            call.streamed = True


def _reasoning_text(delta: ChoiceDelta) -> str:
    # Not part of OpenAI's schema; the SDK keeps unknown fields as extras.
    extra = delta.model_extra or {}
    for name in _REASONING_FIELDS:
        value = extra.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def usage_report(usage: CompletionUsage | None) -> UsageReport:
    """Map OpenAI usage; ``input_tokens`` excludes tokens read from or written to cache."""
    if usage is None:
        return UsageReport()
    prompt = usage.prompt_tokens or 0
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    written = (details.cache_write_tokens or 0) if details else 0
    output_details = usage.completion_tokens_details
    reasoning = (output_details.reasoning_tokens or 0) if output_details else 0
    return UsageReport(
        input_tokens=max(prompt - cached - written, 0),
        output_tokens=usage.completion_tokens or 0,
        cache_creation_input_tokens=written,
        cache_read_input_tokens=cached,
        reasoning_tokens=reasoning,
    )


# --- errors ----------------------------------------------------------------

# vLLM and most compatible servers send no code, only OpenAI's message text:
# "maximum context length is N tokens" (OpenAI, vLLM), llama.cpp's "exceeds the
# available context size", "Requested tokens (N) exceed context window of M"
# (llama-cpp-python) and "context shift is disabled", Ollama's "input length
# exceeds the context length".
_CONTEXT_MESSAGE = re.compile(
    r"context[_ ]length|maximum context|context size|context window|context shift",
    re.I,
)
_TRANSIENT_TYPES = {"server_error", "internal_error", "overloaded_error", "service_unavailable"}
_RETRYABLE_STATUS = {408, 409, 429}


def provider_error(exc: OpenAIError) -> ProviderError:
    """Classify an SDK error: rate limit, context overflow, or other; retryable or not."""
    if isinstance(exc, APIConnectionError):  # includes timeouts and resets mid-stream
        return ProviderError(
            ErrorCode.LLM_PROVIDER_ERROR,
            f"{exc.message} ({exc.__cause__!r})" if exc.__cause__ else exc.message,
            details={"provider": "openai"},
            retryable=True,
        )
    if not isinstance(exc, APIError):
        return ProviderError(ErrorCode.LLM_PROVIDER_ERROR, str(exc), details={"provider": "openai"})
    status = exc.status_code if isinstance(exc, APIStatusError) else None
    details = {
        key: value
        for key, value in {
            "provider": "openai",
            "type": exc.type,
            "code": exc.code,
            "param": exc.param,
            "request_id": exc.request_id if isinstance(exc, APIStatusError) else None,
        }.items()
        if value is not None
    }
    kind = f"{exc.type or ''} {exc.code or ''}"
    if _is_context_overflow(exc, status):
        code, retryable = ErrorCode.CONTEXT_OVERFLOW, False
    elif status == 429 or (status is None and "rate_limit" in kind):
        # insufficient_quota is a 429 too, but waiting does not bring credit back.
        code, retryable = ErrorCode.LLM_RATE_LIMITED, exc.code != "insufficient_quota"
    elif status is not None:
        code = ErrorCode.LLM_PROVIDER_ERROR
        retryable = status >= 500 or status in _RETRYABLE_STATUS
    else:
        # An error event inside a 200 stream: retry what looks transient.
        code = ErrorCode.LLM_PROVIDER_ERROR
        retryable = bool(set(kind.split()) & _TRANSIENT_TYPES) or _is_5xx_code(exc.code)
    retry_after = None
    if isinstance(exc, APIStatusError):
        headers = exc.response.headers
        retry_after = parse_retry_after(headers)
        should_retry = headers.get("x-should-retry")
        if should_retry in ("true", "false") and code != ErrorCode.CONTEXT_OVERFLOW:
            retryable = should_retry == "true"
    return ProviderError(
        code,
        exc.message,
        details=details,
        retryable=retryable,
        retry_after=retry_after,
        status=status,
    )


def _is_context_overflow(exc: APIError, status: int | None) -> bool:
    if exc.code == "context_length_exceeded" or exc.type == "exceed_context_size_error":
        return True  # OpenAI's code; llama.cpp's type
    if status is not None and not 400 <= status < 500:
        return False
    return bool(_CONTEXT_MESSAGE.search(exc.message))


def _is_5xx_code(code: str | None) -> bool:
    # llama.cpp puts the HTTP status in error.code.
    return code is not None and code.isdigit() and int(code) >= 500


def parse_retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait, from the retry headers (``waits.retry_after``)."""
    return retry_after(headers)
