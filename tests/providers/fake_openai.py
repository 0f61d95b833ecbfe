"""Replies in OpenAI's Chat Completions (and Embeddings) wire format, for a :class:`WireServer`.

A streamed completion is data-only SSE: one ``chat.completion.chunk`` object
per event, the choice's ``delta`` carrying ``role`` first, then ``content``
or ``tool_calls`` fragments (``index``/``id``/``type``/``function.name`` on a
call's first fragment, ``function.arguments`` pieces after), then an empty
delta with ``finish_reason``; with ``stream_options.include_usage`` every
chunk has ``"usage": null`` and one last chunk with ``"choices": []`` carries
the usage; ``data: [DONE]`` ends the stream. Reasoning from compatible
servers (vLLM, DeepSeek, Ollama) arrives as ``delta.reasoning_content`` or
``delta.reasoning``. Errors are ``{"error": {message, type, param, code}}``,
as the HTTP body or, mid-stream, as a data event of a 200 response.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

from tests.providers.wire import SSE, Recorded, Reply, Responder

MODEL = "gpt-4o-2024-08-06"
COMPLETION_ID = "chatcmpl-B9MHDbslfkBeAs8l4bebGdFOJ6PeG"
CREATED = 1_725_000_000
FINGERPRINT = "fp_f9f4fb6dbf"

# (call id, function name, argument fragments that concatenate to the JSON input)
ToolCallScript = tuple[str, str, Sequence[str]]


def chunk(
    delta: dict[str, Any] | None = None,
    *,
    finish_reason: str | None = None,
    model: str = MODEL,
) -> SSE:
    """One ``chat.completion.chunk`` with a single choice, as OpenAI sends it."""
    return SSE(
        {
            "id": COMPLETION_ID,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": model,
            "service_tier": "default",
            "system_fingerprint": FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "delta": delta if delta is not None else {},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
            "usage": None,
            "obfuscation": "Qx3z",
        }
    )


def usage(
    prompt_tokens: int = 19,
    completion_tokens: int = 10,
    *,
    cached_tokens: int = 0,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """A ``usage`` object with every detail field OpenAI fills in."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def usage_chunk(usage_body: dict[str, Any] | None = None) -> SSE:
    """The last chunk of an ``include_usage`` stream: no choices, only usage."""
    return SSE(
        {
            "id": COMPLETION_ID,
            "object": "chat.completion.chunk",
            "created": CREATED,
            "model": MODEL,
            "service_tier": "default",
            "system_fingerprint": FINGERPRINT,
            "choices": [],
            "usage": usage_body if usage_body is not None else usage(),
            "obfuscation": "k9",
        }
    )


DONE = SSE("[DONE]")


def _ending(finish_reason: str, usage_body: dict[str, Any] | None) -> list[SSE]:
    return [chunk({}, finish_reason=finish_reason), usage_chunk(usage_body), DONE]


def text_events(
    parts: Sequence[str],
    *,
    finish_reason: str = "stop",
    usage_body: dict[str, Any] | None = None,
) -> list[SSE]:
    first = chunk({"role": "assistant", "content": "", "refusal": None})
    return [first, *(chunk({"content": p}) for p in parts), *_ending(finish_reason, usage_body)]


def text_reply(
    parts: Sequence[str],
    *,
    finish_reason: str = "stop",
    usage_body: dict[str, Any] | None = None,
) -> Reply:
    """A plain answer streamed as one content delta per part."""
    return Reply(events=text_events(parts, finish_reason=finish_reason, usage_body=usage_body))


def thinking_reply(
    thinking: Sequence[str],
    text: Sequence[str],
    *,
    fields: Sequence[str] = ("reasoning_content",),
    usage_body: dict[str, Any] | None = None,
) -> Reply:
    """Reasoning deltas then content deltas, as vLLM/DeepSeek stream them.

    ``fields`` names the delta field(s) carrying the reasoning: vLLM's older
    ``reasoning_content``, its newer ``reasoning``, or both at once (what vLLM
    sends while it keeps the old name for compatibility).
    """
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk(dict.fromkeys(fields, part)) for part in thinking]
    events += [chunk({"content": part}) for part in text]
    return Reply(events=events + _ending("stop", usage_body))


def tool_calls_events(
    calls: Sequence[ToolCallScript],
    *,
    text: Sequence[str] = (),
    finish_reason: str = "tool_calls",
    usage_body: dict[str, Any] | None = None,
) -> list[SSE]:
    """Optional text, then each call: a head fragment with id and name, then arguments."""
    events = [chunk({"role": "assistant", "content": None if not text else "", "refusal": None})]
    events += [chunk({"content": part}) for part in text]
    for index, (call_id, name, fragments) in enumerate(calls):
        head = {
            "index": index,
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        events.append(chunk({"tool_calls": [head]}))
        events += [
            chunk({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
            for fragment in fragments
        ]
    return events + _ending(finish_reason, usage_body)


def tool_calls_reply(
    calls: Sequence[ToolCallScript],
    *,
    text: Sequence[str] = (),
    finish_reason: str = "tool_calls",
    usage_body: dict[str, Any] | None = None,
) -> Reply:
    """One or more (parallel) tool calls with their input JSON in fragments."""
    return Reply(
        events=tool_calls_events(
            calls, text=text, finish_reason=finish_reason, usage_body=usage_body
        )
    )


def ollama_parallel_tool_calls_reply(
    calls: Sequence[tuple[str, str, str]], *, finish_reason: str = "tool_calls"
) -> Reply:
    """Ollama's shape: every call whole in one chunk, all of them at index 0."""
    events = [
        SSE(
            {
                "id": "chatcmpl-18",
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": "qwen2.5-coder:7b",
                "system_fingerprint": "fp_ollama",
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [
                                {
                                    "id": call_id,
                                    "index": 0,
                                    "type": "function",
                                    "function": {"name": name, "arguments": arguments},
                                }
                            ],
                        },
                        "finish_reason": None,
                    }
                ],
            }
        )
        for call_id, name, arguments in calls
    ]
    return Reply(events=[*events, *_ending(finish_reason, usage(30, 12))])


# --- embeddings --------------------------------------------------------------

EMBEDDING_MODELS = {"text-embedding-3-small": 1536, "text-embedding-3-large": 3072}
# The most inputs one request may carry.
MAX_EMBEDDING_INPUTS = 2048


def embeddings(vector_of: Callable[[str, int], Sequence[float]]) -> Responder:
    """``POST /v1/embeddings`` answered as OpenAI does, from what was asked.

    ``{"object": "list", "data": [{"object": "embedding", "index": i,
    "embedding": ...}], "model", "usage"}``, one item per input in order.
    ``encoding_format: "base64"`` (what the SDK asks for unless told
    otherwise) gets each vector as the base64 of its little-endian float32s,
    ``"float"`` (or none) as JSON numbers. ``dimensions`` shortens the
    vector and scales it back to unit length, as text-embedding-3 does.
    ``vector_of(text, dims)`` is the "model".
    """

    def answer(request: Recorded) -> Reply:
        body = request.json
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        model = body["model"]
        dims = EMBEDDING_MODELS.get(model, 768)
        wanted = body.get("dimensions") or dims
        data = []
        for index, text in enumerate(inputs):
            vector = list(vector_of(text, dims))[:wanted]
            norm = math.sqrt(sum(x * x for x in vector)) or 1.0
            vector = [x / norm for x in vector]
            embedding: Any = vector
            if body.get("encoding_format") == "base64":
                packed = struct.pack(f"<{len(vector)}f", *vector)
                embedding = base64.b64encode(packed).decode()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        tokens = sum(len(text.split()) + 1 for text in inputs)
        return Reply(
            body={
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
            headers={"x-request-id": "req_embeddings", "openai-model": model},
        )

    return answer


def _refuse_embeddings(body: Any) -> Reply | None:
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or any(t == "" for t in inputs):
        # What the API says to an empty string, or an empty list, as input.
        return _invalid(
            "'$.input' is invalid. Please check the API reference: "
            "https://platform.openai.com/docs/api-reference.",
            None,
        )
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        return _invalid(
            f"'$.input' is invalid. Array must have at most {MAX_EMBEDDING_INPUTS} items.",
            "input",
        )
    return None


# --- errors ----------------------------------------------------------------


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> Any:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def rate_limited(retry_after: str | None = "1") -> Reply:
    """429 as OpenAI sends it; ``retry-after`` only when given."""
    headers = {
        "x-request-id": "req_ratelimited",
        "x-ratelimit-limit-requests": "500",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "120ms",
    }
    if retry_after is not None:
        headers["retry-after"] = retry_after
    message = (
        "Rate limit reached for gpt-4o in organization org-holdfast on requests per min "
        "(RPM): Limit 500, Used 500, Requested 1. Please try again in 120ms. Visit "
        "https://platform.openai.com/account/rate-limits to learn more."
    )
    return Reply(
        status=429,
        body=error_body(message, "requests", "rate_limit_exceeded"),
        headers=headers,
    )


def rate_limit_used_up(reset_in: float) -> Reply:
    """429 with no retry-after: the request limit at 0, reset in a Go-style duration."""
    reply = rate_limited(None)
    reply.headers["x-ratelimit-reset-requests"] = f"{int(reset_in * 1000)}ms"
    reply.headers["x-ratelimit-remaining-tokens"] = "29000"
    reply.headers["x-ratelimit-reset-tokens"] = "6m0s"
    return reply


def server_error() -> Reply:
    message = "The server had an error while processing your request. Sorry about that!"
    return Reply(
        status=500,
        body=error_body(message, "server_error"),
        headers={"x-request-id": "req_servererror"},
    )


def overloaded() -> Reply:
    """OpenAI's overload: a 503 with type ``server_error``."""
    message = (
        "That model is currently overloaded with other requests. You can retry your "
        "request, or contact us through our help center at help.openai.com if the error "
        "persists. (Please include the request ID req_overloaded in your message.)"
    )
    return Reply(
        status=503,
        body=error_body(message, "server_error"),
        headers={"x-request-id": "req_overloaded"},
    )


def context_length_exceeded() -> Reply:
    message = (
        "This model's maximum context length is 128000 tokens. However, your messages "
        "resulted in 130412 tokens. Please reduce the length of the messages."
    )
    return Reply(
        status=400,
        body=error_body(message, "invalid_request_error", "context_length_exceeded", "messages"),
        headers={"x-request-id": "req_context"},
    )


def vllm_context_length_exceeded() -> Reply:
    """vLLM's flavour: OpenAI's message, no ``context_length_exceeded`` code."""
    message = (
        "This model's maximum context length is 8192 tokens. However, you requested "
        "8203 tokens (7691 in the messages, 512 in the completion). Please reduce the "
        "length of the messages or completion."
    )
    return Reply(status=400, body=error_body(message, "BadRequestError", param=None))


# --- broken streams --------------------------------------------------------


def error_mid_stream(parts: Sequence[str]) -> Reply:
    """Some content, then an error event inside the 200 stream, then [DONE]."""
    message = "The server had an error while processing your request. Sorry about that!"
    events = text_events(parts)[: 1 + len(parts)]
    return Reply(events=[*events, SSE(error_body(message, "server_error")), DONE])


def dropped_mid_stream(parts: Sequence[str]) -> Reply:
    """Some content, then the connection is reset before the stream finished."""
    events = text_events(parts)
    return Reply(events=events, break_after=1 + len(parts))


def ended_without_finish(parts: Sequence[str]) -> Reply:
    """Content, then a clean end of body with no finish_reason and no [DONE]."""
    return Reply(events=text_events(parts)[: 1 + len(parts)])


# --- request checks: what the real API refuses with a 400 -------------------


def refuse(request: Recorded) -> Reply | None:
    """The 400 Chat Completions (or Embeddings) answers to this request, or None.

    As the API checks it: an assistant message with ``tool_calls`` is
    followed by one ``tool`` message per call id before any other message,
    and a ``tool`` message answers a call of the assistant message before
    its run of tool messages.
    """
    if not isinstance(request.json, dict):
        return None
    if request.path.endswith("/embeddings"):
        return _refuse_embeddings(request.json)
    if not request.path.endswith("/chat/completions"):
        return None
    messages = request.json.get("messages") or []
    open_calls: list[str] = []  # calls of the last assistant message not yet answered
    for n, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            if message.get("tool_call_id") not in open_calls:
                return _invalid(
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    "preceeding message with 'tool_calls'.",
                    f"messages.[{n}].role",
                )
            open_calls.remove(message["tool_call_id"])
            continue
        if open_calls:
            return _missing_responses(open_calls, n)
        if role == "assistant":
            open_calls = [call["id"] for call in message.get("tool_calls") or []]
    if open_calls:
        return _missing_responses(open_calls, len(messages))
    return None


def _missing_responses(ids: list[str], n: int) -> Reply:
    return _invalid(
        "An assistant message with 'tool_calls' must be followed by tool messages responding "
        "to each 'tool_call_id'. The following tool_call_ids did not have response messages: "
        + ", ".join(ids),
        f"messages.[{n}].role",
    )


def _invalid(message: str, param: str | None) -> Reply:
    return Reply(
        status=400,
        body=error_body(message, "invalid_request_error", param=param),
        headers={"x-request-id": "req_invalid"},
    )
