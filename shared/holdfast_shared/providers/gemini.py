"""The ``gemini`` provider: Google Gemini through the ``google-genai`` SDK.

Consumes a :class:`ModelRequest`; produces the normalized stream of
``base.py``. On the wire it is one ``POST /v1beta/models/{model}:
streamGenerateContent?alt=sse`` (key in ``x-goog-api-key``) answered by
data-only SSE lines, each a whole ``GenerateContentResponse``: a slice of
``candidates[0].content.parts`` (``text``, ``thought: true`` summaries, whole
``functionCall`` parts, each maybe carrying a ``thoughtSignature``), a running
``usageMetadata`` and, on the last one, ``finishReason``.

What it guarantees beyond the stream contract:

* Thought signatures come out as the ``signature`` of the block whose part
  carried them (on :class:`BlockStop`, base64) and go back on the same kind of
  part later: Gemini rejects a replayed ``functionCall`` that lost its own.
* The SDK neither retries nor resumes (``stream_with_retries`` does that), so
  a failure always surfaces here as a :class:`ProviderError`.
* Media (``holdfast_shared.media_support``) go before the text of their user turn:
  base64 items as ``inlineData``, URLs as ``fileData`` (Gemini fetches public
  and signed http(s) URLs itself). Anything else fails the call as
  ``UNSUPPORTED_MEDIA`` before a byte is sent. Tool calls and results go out
  paired (``toolpairs.paired``).
* Prompt caching is implicit on Gemini: a request whose prompt starts like a
  recent one's reads its cache. So the prefix stays put: the system
  instruction is the system prompt then the soul, tools follow, then the
  contents oldest first, and ``notes`` go last, as a text part of the last
  user turn. The body's bytes follow the same order: the SDK would put
  ``contents`` first, so they travel in ``HttpOptions.extra_body`` (the SDK's
  way to add body fields, appended after the ones it builds), dumped to the
  wire format the SDK itself would send.
* Structured output (``output_schema``, ``structured.py``): the turn's own
  calls go out with ``responseMimeType: application/json`` and the schema as
  ``responseJsonSchema`` (JSON Schema as it is; ``responseSchema`` takes only
  the OpenAPI subset of Gemini's Schema type). The JSON answer is the text.
  Models before Gemini 3 refuse a JSON response beside function
  declarations: with tools, they get the schema in the system instruction.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from google import genai
from google.genai import errors, types

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.errors import ErrorCode
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

API_KEY_VARIABLES = ("GEMINI_API_KEY", "GOOGLE_API_KEY")
BASE_URL_VARIABLE = "HOLDFAST_GEMINI_BASE_URL"
# google-genai 3.x defaults to "v1"; thought summaries, signatures and JSON
# Schema tool parameters are documented on v1beta, so pin it (and ignore the
# SDK's GOOGLE_GENAI_API_VERSION variable).
API_VERSION = "v1beta"

# Ids we invent for calls Gemini sent without one; never sent back, since the
# server did not issue them (it matches responses by name and order then).
_GENERATED_ID = re.compile(r"call_[0-9a-f]{32}")
# Google's documented stand-in for a lost signature on Gemini 3, which
# otherwise answers 400 to a replayed function call without one.
_SKIP_SIGNATURE = "skip_thought_signature_validator"
_SIGNED_MODELS = re.compile(r"(?:models/)?gemini-(\d+)")
_CONTEXT_OVERFLOW = re.compile(
    r"input token count|exceeds the maximum number of tokens|context (?:window|length)", re.I
)
_STOP_REASONS = {"STOP": "end_turn", "MAX_TOKENS": "max_tokens", "CONTINUATION": "max_tokens"}


def _transport_errors() -> tuple[type[Exception], ...]:
    # The SDK sends through httpx2 by default and httpx when configured
    # (GOOGLE_GENAI_HTTP_CLIENT); neither wraps its exceptions.
    found: list[type[Exception]] = []
    for name in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(name).TransportError)
        except ImportError:
            continue
    return tuple(found)


# Everything a model call can fail with that provider_error() translates.
_CALL_ERRORS: tuple[type[Exception], ...] = (
    errors.APIError,
    errors.UnknownApiResponseError,
    *_transport_errors(),
)


class GeminiProvider:
    name = "gemini"

    def __init__(
        self,
        *,
        api_key: str,
        base_url: str | None = None,
        include_thoughts: bool = True,
        timeout: float | None = None,
    ) -> None:
        """``timeout`` (seconds) bounds each request; None leaves it to the turn deadline."""
        self.include_thoughts = include_thoughts
        self._client = genai.Client(
            vertexai=False,
            api_key=api_key,
            http_options=types.HttpOptions(
                base_url=base_url,
                api_version=API_VERSION,
                timeout=None if timeout is None else int(timeout * 1000),
                # One attempt: retrying is stream_with_retries' job.
                retry_options=types.HttpRetryOptions(attempts=1),
            ),
        )

    async def aclose(self) -> None:
        await self._client.aio.aclose()

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        media.require_supported(self.name, request)
        contents = to_contents(request.messages, request.model, notes=request.notes)
        translator = _Translator()
        try:
            responses = await self._client.aio.models.generate_content_stream(
                model=request.model,
                # In the body after everything else: see _config.
                contents=cast("list[types.Content]", None),
                config=self._config(request, contents),
            )
            try:
                async for response in responses:
                    for event in translator.feed(response):
                        yield event
            finally:
                # Release the connection now, not when the generator is collected.
                aclose = getattr(responses, "aclose", None)
                if aclose is not None:
                    await aclose()
        except _CALL_ERRORS as exc:
            raise provider_error(exc) from exc
        for event in translator.finish():
            yield event

    def _config(
        self, request: ModelRequest, contents: list[types.Content]
    ) -> types.GenerateContentConfig:
        tools = None
        if request.tools:
            tools = [
                types.Tool(
                    function_declarations=[
                        types.FunctionDeclaration(
                            name=tool.name,
                            description=tool.description,
                            parameters_json_schema=tool.input_schema,
                        )
                        for tool in request.tools
                    ]
                )
            ]
        system = [text for text in (request.system, request.soul) if text]
        # Structured output (``output_schema``): the JSON Schema as it is
        # (``response_json_schema``; ``response_schema`` takes only the OpenAPI
        # subset Gemini's Schema type knows, which a user's schema may leave).
        # Before Gemini 3, a JSON response with function declarations is a 400:
        # then the schema is asked for in the system instruction instead.
        schema = structured.wanted(request)
        if schema is not None and request.tools and not _tools_with_json(request.model):
            system.append(structured.instruction(schema))
            schema = None
        return types.GenerateContentConfig(
            system_instruction=cast("list[types.PartUnion]", system) or None,
            max_output_tokens=request.max_tokens,
            tools=tools,
            response_mime_type="application/json" if schema is not None else None,
            response_json_schema=schema,
            thinking_config=(
                types.ThinkingConfig(include_thoughts=True) if self.include_thoughts else None
            ),
            # The loop runs the tools; the SDK must neither call them nor
            # re-request on its own (continuation would repeat streamed text).
            automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True),
            automatic_continuation=False,
            # The SDK appends extra_body's fields to the body it built (system
            # instruction, tools, generation config), so the contents, the part
            # that grows, come last and the bytes before them stay the same.
            http_options=types.HttpOptions(extra_body={"contents": to_wire(contents)}),
        )


def from_env(environ: Mapping[str, str]) -> GeminiProvider | None:
    """A provider when ``GEMINI_API_KEY`` (or ``GOOGLE_API_KEY``) is set, else None."""
    api_key = next((environ[v] for v in API_KEY_VARIABLES if environ.get(v)), None)
    if api_key is None:
        return None
    return GeminiProvider(api_key=api_key, base_url=environ.get(BASE_URL_VARIABLE) or None)


# --- request: neutral blocks → Gemini contents -------------------------------


def to_contents(
    messages: Iterable[ChatMessage], model: str, *, notes: str = ""
) -> list[types.Content]:
    """The history as Gemini ``contents``: ``user``/``model`` turns of parts,
    ``notes`` the last part of the last user turn."""
    messages = paired(messages)
    tool_names = {
        b["id"]: b["name"] for m in messages for b in m.blocks if b.get("type") == "tool_use"
    }
    stub_lost_signatures = _requires_signatures(model)
    contents: list[types.Content] = []
    for message in messages:
        if message.role == "assistant":
            parts = _model_parts(message.blocks, stub_lost_signatures)
            role = "model"
        else:
            parts = _user_parts(message, tool_names)
            role = "user"
        if not parts:
            continue  # Gemini rejects a turn without parts.
        if contents and contents[-1].role == role:
            # Keep turns alternating, e.g. all results of one step in one turn.
            contents[-1].parts = [*(contents[-1].parts or []), *parts]
        else:
            contents.append(types.Content(role=role, parts=parts))
    if notes:
        if not contents or contents[-1].role != "user":
            contents.append(types.Content(role="user", parts=[]))
        contents[-1].parts = [*(contents[-1].parts or []), types.Part(text=notes)]
    return contents


def to_wire(contents: list[types.Content]) -> list[dict[str, Any]]:
    """``contents`` as JSON, as the SDK would send them (camelCase, bytes in base64)."""
    return [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in contents]


def _user_parts(message: ChatMessage, tool_names: dict[str, str]) -> list[types.Part]:
    # Function responses first (they answer the turn before), then media, then text.
    texts: list[types.Part] = []
    parts: list[types.Part] = []
    for block in message.blocks:
        if block.get("type") == "text" and block.get("text"):
            texts.append(types.Part(text=block["text"]))
        elif block.get("type") == "tool_result":
            call_id = block["tool_use_id"]
            if call_id not in tool_names:
                raise ProviderError(
                    ErrorCode.LLM_PROVIDER_ERROR,
                    f"tool result {call_id!r} has no matching tool call in the history",
                )
            # Gemini's convention: "output" for a result, "error" for a failure.
            response: dict[str, Any] = {}
            if block.get("output") is not None:
                response["output"] = block["output"]
            if block.get("error"):
                response["error"] = block["error"]
            parts.append(
                types.Part(
                    function_response=types.FunctionResponse(
                        id=_wire_id(call_id), name=tool_names[call_id], response=response
                    )
                )
            )
    return [*parts, *map(_media_part, message.media), *texts]


def _media_part(item: Mapping[str, Any]) -> types.Part:
    kind = media.media_type(item)
    if media.is_linked(item):
        return types.Part(file_data=types.FileData(mime_type=kind, file_uri=str(item["url"])))
    return types.Part(inline_data=types.Blob(mime_type=kind, data=media.decoded(item)))


def _model_parts(
    blocks: tuple[dict[str, Any], ...], stub_lost_signatures: bool
) -> list[types.Part]:
    parts: list[types.Part] = []
    for block in blocks:
        signature = _decode_signature(block.get("signature"))
        kind = block.get("type")
        if kind == "tool_use":
            call = types.FunctionCall(
                id=_wire_id(block["id"]), name=block["name"], args=block.get("input") or {}
            )
            parts.append(types.Part(function_call=call, thought_signature=signature))
        elif kind == "thinking" and signature is not None:
            # Unsigned summaries are dropped: Gemini reads nothing from them.
            parts.append(
                types.Part(text=block.get("text", ""), thought=True, thought_signature=signature)
            )
        elif kind == "text" and (block.get("text") or signature is not None):
            parts.append(types.Part(text=block.get("text", ""), thought_signature=signature))
    if stub_lost_signatures and not any(p.thought_signature for p in parts):
        # Only the first call of a step is signed; stub it when the history lost it.
        first_call = next((p for p in parts if p.function_call is not None), None)
        if first_call is not None:
            first_call.thought_signature = base64.urlsafe_b64decode(_SKIP_SIGNATURE)
    return parts


def _wire_id(call_id: str) -> str | None:
    return None if _GENERATED_ID.fullmatch(call_id) else call_id


def _requires_signatures(model: str) -> bool:
    match = _SIGNED_MODELS.match(model)
    return match is not None and int(match.group(1)) >= 3


def _tools_with_json(model: str) -> bool:
    """Whether the model takes function calling and a JSON response schema in
    one request (Gemini 3 on; earlier ones answer 400 "Function calling with a
    response mime type: 'application/json' is unsupported")."""
    match = _SIGNED_MODELS.match(model)
    return match is not None and int(match.group(1)) >= 3


def _encode_signature(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _decode_signature(value: Any) -> bytes | None:
    if not value:
        return None
    text = str(value).translate({ord("-"): "+", ord("_"): "/"})  # either base64 alphabet
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except binascii.Error:
        return None  # Not a signature Gemini could have issued; sending it would be a 400.


# --- response: Gemini chunks → normalized events ----------------------------


@dataclass
class _OpenBlock:
    index: int
    kind: BlockType
    signature: str | None = None


class _Translator:
    """Turns the chunks of one streamed response into blocks, usage and finish."""

    def __init__(self) -> None:
        self._open: _OpenBlock | None = None
        self._next_index = 0
        self._called_tools = False
        self._finish_reason: str | None = None
        self._finish_message: str | None = None
        self._blocked: str | None = None
        self._usage: types.GenerateContentResponseUsageMetadata | None = None

    def feed(self, response: types.GenerateContentResponse) -> list[ModelEvent]:
        # usageMetadata is a running total for the call: keep the latest.
        if response.usage_metadata is not None:
            self._usage = response.usage_metadata
        feedback = response.prompt_feedback
        if feedback is not None and feedback.block_reason is not None:
            self._blocked = _enum_value(feedback.block_reason)
        if not response.candidates:
            return []
        candidate = response.candidates[0]
        events: list[ModelEvent] = []
        for part in (candidate.content.parts if candidate.content else None) or []:
            events.extend(self._part(part))
        if candidate.finish_reason is not None:
            self._finish_reason = _enum_value(candidate.finish_reason)
            self._finish_message = candidate.finish_message
        return events

    def finish(self) -> list[ModelEvent]:
        events = self._close()
        raw = self._finish_reason or self._blocked
        if raw is None:
            # A proxy or server that cut the stream short without a reset.
            raise ProviderError(
                ErrorCode.LLM_PROVIDER_ERROR,
                "the Gemini stream ended without a finish reason",
                retryable=True,
            )
        stop_reason = _STOP_REASONS.get(raw, "end_turn")
        if raw == "STOP" and self._called_tools:
            stop_reason = "tool_use"
        extra: dict[str, Any] = {"raw_stop_reason": raw}
        if self._finish_reason is None:
            extra["prompt_blocked"] = True  # promptFeedback.blockReason, no candidate at all
        if self._finish_message:
            extra["finish_message"] = self._finish_message
        events.append(self._usage_report())
        events.append(Finish(stop_reason, extra))
        return events

    def _part(self, part: types.Part) -> list[ModelEvent]:
        signature = _encode_signature(part.thought_signature) if part.thought_signature else None
        if part.function_call is not None:
            # Calls arrive whole: one block with its complete input JSON.
            closed = self._close()
            call = part.function_call
            index = self._take_index()
            self._called_tools = True
            return [
                *closed,
                BlockStart(
                    index,
                    "tool_use",
                    tool_name=call.name,
                    tool_call_id=call.id or f"call_{uuid.uuid4().hex}",
                ),
                ToolInputChunk(index, json.dumps(call.args or {})),
                BlockStop(index, signature=signature),
            ]
        if part.text is None or (not part.text and signature is None):
            return []  # Parts we do not model (media, code execution) and empty keep-alives.
        kind: BlockType = "thinking" if part.thought else "text"
        events: list[ModelEvent] = []
        block = self._open
        # A signature ends its part, so text after it starts a new block.
        if block is None or block.kind != kind or block.signature is not None:
            events = self._close()
            block = self._open = _OpenBlock(self._take_index(), kind)
            events.append(BlockStart(block.index, kind))
        if part.text:
            chunk = ThinkingChunk if kind == "thinking" else TextChunk
            events.append(chunk(block.index, part.text))
        if signature is not None:
            block.signature = signature
        return events

    def _close(self) -> list[ModelEvent]:
        block, self._open = self._open, None
        return [] if block is None else [BlockStop(block.index, signature=block.signature)]

    def _take_index(self) -> int:
        self._next_index += 1
        return self._next_index - 1

    def _usage_report(self) -> UsageReport:
        usage = self._usage
        if usage is None:
            return UsageReport()
        cached = usage.cached_content_token_count or 0
        return UsageReport(
            # promptTokenCount includes the cached prefix.
            input_tokens=(usage.prompt_token_count or 0) - cached,
            output_tokens=usage.candidates_token_count or 0,
            cache_read_input_tokens=cached,
            reasoning_tokens=usage.thoughts_token_count or 0,
        )


def _enum_value(value: Any) -> str:
    return str(getattr(value, "value", value))


# --- errors -------------------------------------------------------------------


def provider_error(exc: Exception) -> ProviderError:
    """The SDK's or transport's exception as a :class:`ProviderError`."""
    if isinstance(exc, errors.APIError):
        return _api_error(exc)
    if isinstance(exc, errors.UnknownApiResponseError):
        return malformed_stream("gemini", exc)
    # Connection refused or reset, timeouts, a stream cut mid-body.
    return ProviderError(
        ErrorCode.LLM_PROVIDER_ERROR,
        f"connection to Gemini failed: {type(exc).__name__}: {exc}",
        retryable=True,
    )


def _api_error(exc: errors.APIError) -> ProviderError:
    code = int(exc.code) if exc.code else None
    message = f"Gemini {code} {exc.status}: {exc.message}"
    details = {"provider_status": exc.status}
    if code == 429 or exc.status == "RESOURCE_EXHAUSTED":
        return ProviderError(
            ErrorCode.LLM_RATE_LIMITED,
            message,
            details=details,
            retryable=True,
            retry_after=_retry_after(exc),
            status=code,
        )
    if code == 400 and _CONTEXT_OVERFLOW.search(exc.message or ""):
        return ProviderError(ErrorCode.CONTEXT_OVERFLOW, message, details=details, status=code)
    # 5xx covers 503 UNAVAILABLE "The model is overloaded" and 504 deadlines.
    retryable = code is not None and (code >= 500 or code == 408)
    return ProviderError(
        ErrorCode.LLM_PROVIDER_ERROR,
        message,
        details=details,
        retryable=retryable,
        retry_after=_retry_after(exc) if retryable else None,
        status=code,
    )


def _retry_after(exc: errors.APIError) -> float | None:
    headers = getattr(exc.response, "headers", None)
    hinted = retry_after(headers) if headers is not None else None
    if hinted is not None:
        return hinted
    # Gemini itself puts the wait in the body: a google.rpc.RetryInfo detail
    # with a protobuf duration such as "47.434392449s".
    body = exc.details if isinstance(exc.details, dict) else {}
    error = body.get("error", body)
    for detail in error.get("details", []) if isinstance(error, dict) else []:
        delay = detail.get("retryDelay") if isinstance(detail, dict) else None
        if isinstance(delay, str) and delay.endswith("s"):
            try:
                return float(delay[:-1])
            except ValueError:
                return None
    return None
