"""Replies in the Anthropic Messages API's streaming wire format, for a WireServer.

A stream is ``message_start`` (usage with input and cache counts,
``output_tokens`` already 1), then per content block ``content_block_start``
/ ``content_block_delta``… / ``content_block_stop`` (a ``ping`` after the
first start, as the API sends), then ``message_delta`` (stop reason and
cumulative usage) and ``message_stop``. Errors are JSON bodies
``{"type": "error", "error": {"type", "message"}, "request_id"}`` with their
HTTP status, or the same object as an ``event: error`` inside a 200 stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.providers.wire import SSE, Recorded, Reply

MODEL = "claude-sonnet-4-6"
SIGNATURE = "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"
REDACTED = (
    "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpPkNRj2YfWXGmKDxH4mPnZ5sQ7vB5URj"
)


@dataclass(frozen=True)
class Usage:
    """Token counts as the API reports them: ``input_tokens`` excludes cached ones."""

    input_tokens: int = 25
    output_tokens: int = 12
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    thinking_tokens: int | None = None


def _event(data: dict[str, Any]) -> SSE:
    return SSE(data, event=str(data["type"]))


def message_start(usage: Usage, message_id: str = "msg_01XFDUDYJgAACzvnptvVoYEL") -> SSE:
    return _event(
        {
            "type": "message_start",
            "message": {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": MODEL,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "stop_details": None,
                "usage": {
                    "input_tokens": usage.input_tokens,
                    "cache_creation_input_tokens": usage.cache_creation_input_tokens,
                    "cache_read_input_tokens": usage.cache_read_input_tokens,
                    "cache_creation": {
                        "ephemeral_5m_input_tokens": usage.cache_creation_input_tokens,
                        "ephemeral_1h_input_tokens": 0,
                    },
                    "output_tokens": 1,
                    "service_tier": "standard",
                },
            },
        }
    )


def ping() -> SSE:
    return _event({"type": "ping"})


def block_start(index: int, content_block: dict[str, Any]) -> SSE:
    return _event({"type": "content_block_start", "index": index, "content_block": content_block})


def block_delta(index: int, delta: dict[str, Any]) -> SSE:
    return _event({"type": "content_block_delta", "index": index, "delta": delta})


def block_stop(index: int) -> SSE:
    return _event({"type": "content_block_stop", "index": index})


def message_delta(stop_reason: str, usage: Usage, stop_sequence: str | None = None) -> SSE:
    # Cumulative counts: the API repeats the input and cache counts here.
    counts: dict[str, Any] = {
        "input_tokens": usage.input_tokens,
        "cache_creation_input_tokens": usage.cache_creation_input_tokens,
        "cache_read_input_tokens": usage.cache_read_input_tokens,
        "output_tokens": usage.output_tokens,
    }
    if usage.thinking_tokens is not None:
        counts["output_tokens_details"] = {"thinking_tokens": usage.thinking_tokens}
    return _event(
        {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "stop_details": None,
            },
            "usage": counts,
        }
    )


def message_stop() -> SSE:
    return _event({"type": "message_stop"})


def text_block(index: int, chunks: list[str]) -> list[SSE]:
    return [
        block_start(index, {"type": "text", "text": ""}),
        *(block_delta(index, {"type": "text_delta", "text": c}) for c in chunks),
        block_stop(index),
    ]


def thinking_block(index: int, chunks: list[str], signature: str = SIGNATURE) -> list[SSE]:
    return [
        block_start(index, {"type": "thinking", "thinking": "", "signature": ""}),
        *(block_delta(index, {"type": "thinking_delta", "thinking": c}) for c in chunks),
        # The signature arrives in one delta just before the block stops.
        block_delta(index, {"type": "signature_delta", "signature": signature}),
        block_stop(index),
    ]


def redacted_thinking_block(index: int, data: str = REDACTED) -> list[SSE]:
    # Redacted thinking carries its opaque data in the start event; no deltas.
    return [block_start(index, {"type": "redacted_thinking", "data": data}), block_stop(index)]


def tool_use_block(index: int, tool_id: str, name: str, fragments: list[str]) -> list[SSE]:
    return [
        block_start(index, {"type": "tool_use", "id": tool_id, "name": name, "input": {}}),
        # The API opens the input stream with an empty fragment.
        block_delta(index, {"type": "input_json_delta", "partial_json": ""}),
        *(block_delta(index, {"type": "input_json_delta", "partial_json": f}) for f in fragments),
        block_stop(index),
    ]


def _stream(blocks: list[list[SSE]], stop_reason: str, usage: Usage) -> list[SSE]:
    events = [message_start(usage)]
    for n, block in enumerate(blocks):
        events.extend(block)
        if n == 0:
            events.insert(2, ping())
    events += [message_delta(stop_reason, usage), message_stop()]
    return events


def text_reply(
    chunks: list[str], usage: Usage | None = None, stop_reason: str = "end_turn"
) -> Reply:
    """A plain text answer streamed as several deltas."""
    return Reply(events=_stream([text_block(0, chunks)], stop_reason, usage or Usage()))


def thinking_reply(
    thinking: list[str], text: list[str], usage: Usage | None = None, signature: str = SIGNATURE
) -> Reply:
    """A signed thinking block, then the text answer."""
    usage = usage or Usage(output_tokens=40, thinking_tokens=28)
    blocks = [thinking_block(0, thinking, signature), text_block(1, text)]
    return Reply(events=_stream(blocks, "end_turn", usage))


def tool_call_reply(
    tool_id: str,
    name: str,
    fragments: list[str],
    *,
    text: list[str] | None = None,
    thinking: list[str] | None = None,
    redacted: bool = False,
    usage: Usage | None = None,
) -> Reply:
    """A tool call with its input streamed in fragments, optionally after thinking/text."""
    blocks: list[list[SSE]] = []
    if thinking is not None:
        blocks.append(thinking_block(len(blocks), thinking))
    if redacted:
        blocks.append(redacted_thinking_block(len(blocks)))
    if text is not None:
        blocks.append(text_block(len(blocks), text))
    blocks.append(tool_use_block(len(blocks), tool_id, name, fragments))
    return Reply(events=_stream(blocks, "tool_use", usage or Usage(output_tokens=60)))


# --- errors ---------------------------------------------------------------


def error_body(error_type: str, message: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": error_type, "message": message},
        "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy",
    }


def _error(status: int, error_type: str, message: str, **headers: str) -> Reply:
    headers = {"request-id": "req_011CSHoEeqs5C35K2UUqR7Fy", **headers}
    return Reply(status=status, body=error_body(error_type, message), headers=headers)


def rate_limited(retry_after: str = "1") -> Reply:
    return _error(
        429,
        "rate_limit_error",
        "This request would exceed the rate limit for your organization of 50 requests per minute.",
        **{"retry-after": retry_after},
    )


def rate_limit_used_up(reset_in: float) -> Reply:
    """429 with no retry-after: the requests limit at 0, reset at an RFC 3339 time."""
    reset = datetime.now(UTC) + timedelta(seconds=reset_in)
    return _error(
        429,
        "rate_limit_error",
        "This request would exceed the rate limit for your organization of 50 requests per minute.",
        **{
            "anthropic-ratelimit-requests-limit": "50",
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": reset.isoformat().replace("+00:00", "Z"),
            "anthropic-ratelimit-tokens-remaining": "39000",
            "anthropic-ratelimit-tokens-reset": (reset + timedelta(hours=1)).isoformat(),
        },
    )


def spend_limit_reached() -> Reply:
    # Same status and type as a rate limit; only ``details.error_code`` tells them apart.
    reply = _error(
        429, "rate_limit_error", "Your organization has reached its monthly spend limit."
    )
    reply.body["error"]["details"] = {"error_code": "enforced_spend_limit_reached"}
    return reply


def server_error() -> Reply:
    return _error(500, "api_error", "Internal server error")


def overloaded() -> Reply:
    # Anthropic signals overload with its own 529, not 503.
    return _error(529, "overloaded_error", "Overloaded")


def context_overflow() -> Reply:
    return _error(
        400, "invalid_request_error", "prompt is too long: 208310 tokens > 200000 maximum"
    )


def error_midstream(chunks: list[str], error_type: str = "overloaded_error") -> Reply:
    """Text deltas, then ``event: error`` inside the 200 stream; no message_stop."""
    start = _stream([text_block(0, chunks)], "end_turn", Usage())[:-3]  # drop stop, delta, stop
    message = "Overloaded" if error_type == "overloaded_error" else "Internal server error"
    return Reply(events=[*start, SSE(error_body(error_type, message), event="error")])


def dropped_midstream(chunks: list[str]) -> Reply:
    """Text deltas, then the connection resets before the block ends."""
    events = text_reply(chunks).events or []
    # message_start, text start, ping, the deltas: then the reset.
    return Reply(events=events, break_after=3 + len(chunks))


# --- request checks: what the real API refuses with a 400 -------------------

MAX_CACHE_BREAKPOINTS = 4


def refuse(request: Recorded) -> Reply | None:
    """The 400 the Messages API answers to this request, or None.

    Checked as the API does: every ``tool_use`` of an assistant message has
    its ``tool_result`` in the next message (a user message, results first),
    every ``tool_result`` answers a ``tool_use`` of the message before it, and
    no more than four blocks carry ``cache_control``.
    """
    if request.path != "/v1/messages" or not isinstance(request.json, dict):
        return None
    body = request.json
    messages = body.get("messages") or []
    for n, message in enumerate(messages):
        blocks = _content(message)
        calls = [b["id"] for b in blocks if b.get("type") == "tool_use"]
        if message.get("role") == "assistant" and calls:
            following = _content(messages[n + 1]) if n + 1 < len(messages) else []
            is_user = n + 1 < len(messages) and messages[n + 1].get("role") == "user"
            answered = {b.get("tool_use_id") for b in following if b.get("type") == "tool_result"}
            missing = [c for c in calls if not is_user or c not in answered]
            if missing:
                return _invalid(
                    f"messages.{n}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {', '.join(missing)}. Each `tool_use` block must have "
                    "a corresponding `tool_result` block in the next message."
                )
        results = [b for b in blocks if b.get("type") == "tool_result"]
        if results:
            before = _content(messages[n - 1]) if n > 0 else []
            made = {b.get("id") for b in before if b.get("type") == "tool_use"}
            for i, block in enumerate(blocks):
                if block.get("type") != "tool_result":
                    continue
                if message.get("role") != "user" or block.get("tool_use_id") not in made:
                    return _invalid(
                        f"messages.{n}.content.{i}: unexpected `tool_use_id` found in "
                        f"`tool_result` blocks: {block.get('tool_use_id')}. Each `tool_result` "
                        "block must have a corresponding `tool_use` block in the previous message."
                    )
            leading = len(results)
            if any(b.get("type") != "tool_result" for b in blocks[:leading]):
                return _invalid(
                    f"messages.{n}: `tool_result` blocks must come before any other content "
                    "in a user message that answers `tool_use` blocks."
                )
    found = len(cache_breakpoints(body))
    if found > MAX_CACHE_BREAKPOINTS:
        return _invalid(
            f"A maximum of {MAX_CACHE_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {found}."
        )
    return None


def cache_breakpoints(body: dict[str, Any]) -> list[str]:
    """Where ``cache_control`` sits: ``tools.N``, ``system.N``, ``messages.N.content.M``."""
    found = [f"tools.{i}" for i, t in enumerate(body.get("tools") or []) if "cache_control" in t]
    system = body.get("system")
    if isinstance(system, list):
        found += [f"system.{i}" for i, b in enumerate(system) if "cache_control" in b]
    for n, message in enumerate(body.get("messages") or []):
        found += [
            f"messages.{n}.content.{i}"
            for i, block in enumerate(_content(message))
            if "cache_control" in block
        ]
    return found


def _content(message: dict[str, Any]) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content or [])


def _invalid(message: str) -> Reply:
    return Reply(status=400, body=error_body("invalid_request_error", message))
