"""The Anthropic provider through the real SDK against a local server speaking the wire format."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from holdfast_loop_worker.blocks import assemble
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers.anthropic import (
    AnthropicProvider,
    from_env,
)
from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    Finish,
    ModelRequest,
    ProviderError,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    ToolSpec,
    UsageReport,
)
from holdfast_shared.providers.calls import StreamInterrupted, stream_with_retries

from tests.providers import fake_anthropic as fake
from tests.providers.streams import CLOCK, SYSTEM, WEATHER, collect, collect_until_error, user
from tests.providers.wire import WireServer

pytestmark = pytest.mark.timeout(30)

API_KEY = "sk-ant-test-0123456789"
TOOL_ID = "toolu_01A09q90qw90lq917835lq9"


@pytest.fixture
async def provider(wire: WireServer) -> AsyncIterator[AnthropicProvider]:
    p = AnthropicProvider(api_key=API_KEY, base_url=wire.url)
    yield p
    await p.aclose()


@pytest.fixture
async def thinking_provider(wire: WireServer) -> AsyncIterator[AnthropicProvider]:
    p = AnthropicProvider(api_key=API_KEY, base_url=wire.url, thinking_budget=2048)
    yield p
    await p.aclose()


def request(*messages: ChatMessage, tools: tuple[ToolSpec, ...] = ()) -> ModelRequest:
    return ModelRequest(
        model=fake.MODEL,
        system=SYSTEM,
        messages=messages or (user("Hello"),),
        tools=tools,
        max_tokens=1024,
    )


# --- streams ---------------------------------------------------------------


async def test_plain_text_is_the_exact_normalized_sequence(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.text_reply(["Hel", "lo, ", "world!"], fake.Usage(25, 12)))

    events = await collect(provider.stream(request()))

    assert events == [
        BlockStart(0, "text"),
        TextChunk(0, "Hel"),
        TextChunk(0, "lo, "),
        TextChunk(0, "world!"),
        BlockStop(0),
        UsageReport(input_tokens=25, output_tokens=12),
        Finish("end_turn", {"raw_stop_reason": "end_turn"}),
    ]
    text = "".join(e.text for e in events if isinstance(e, TextChunk))
    assert text == "Hello, world!"


async def test_request_carries_model_limits_system_tools_and_auth(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.text_reply(["ok"]))

    await collect(provider.stream(request(user("Hi"), tools=(WEATHER, CLOCK))))

    [sent] = wire.requests
    assert (sent.method, sent.path) == ("POST", "/v1/messages")
    body = sent.json
    assert body["model"] == fake.MODEL
    assert body["max_tokens"] == 1024
    assert body["stream"] is True
    assert "thinking" not in body
    # Prompt caching: breakpoints on the system block, the last tool and the newest message.
    assert body["system"] == [
        {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}
    ]
    assert body["tools"] == [
        {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "input_schema": WEATHER.input_schema,
        },
        {
            "name": "get_time",
            "input_schema": {"type": "object", "properties": {}},
            "cache_control": {"type": "ephemeral"},
        },
    ]
    assert body["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}],
        }
    ]
    # This SDK sends the API key as a bearer token, not as x-api-key.
    assert sent.headers["authorization"] == f"Bearer {API_KEY}"
    assert sent.headers["anthropic-version"]
    assert sent.headers["content-type"] == "application/json"


async def test_thinking_then_text_with_signature_and_reasoning_tokens(
    wire: WireServer, thinking_provider: AnthropicProvider
) -> None:
    wire.queue(fake.thinking_reply(["Let me ", "think."], ["The answer ", "is 4."]))

    events = await collect(thinking_provider.stream(request(user("2+2?"))))

    assert events == [
        BlockStart(0, "thinking"),
        ThinkingChunk(0, "Let me "),
        ThinkingChunk(0, "think."),
        BlockStop(0, signature=fake.SIGNATURE),
        BlockStart(1, "text"),
        TextChunk(1, "The answer "),
        TextChunk(1, "is 4."),
        BlockStop(1),
        UsageReport(input_tokens=25, output_tokens=40, reasoning_tokens=28),
        Finish("end_turn", {"raw_stop_reason": "end_turn"}),
    ]
    body = wire.requests[0].json
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    # The thinking budget comes on top of the answer's own max_tokens.
    assert body["max_tokens"] == 1024 + 2048


async def test_tool_call_round_trip_sends_result_and_signed_thinking_back(
    wire: WireServer, thinking_provider: AnthropicProvider
) -> None:
    fragments = ['{"city": ', '"Par', 'is", "un', 'it": "c"}']
    wire.queue(
        fake.tool_call_reply(TOOL_ID, "get_weather", fragments, thinking=["Need the weather."]),
        fake.text_reply(["It is 18°C."]),
    )
    question = user("Weather in Paris?")

    first = await collect(thinking_provider.stream(request(question, tools=(WEATHER,))))

    assert BlockStart(1, "tool_use", "get_weather", TOOL_ID) in first
    chunks = [e.partial_json for e in first if isinstance(e, ToolInputChunk)]
    assert chunks == fragments  # the API's empty opening fragment is not passed on
    assert json.loads("".join(chunks)) == {"city": "Paris", "unit": "c"}
    assert BlockStop(0, signature=fake.SIGNATURE) in first
    assert first[-1] == Finish("tool_use", {"raw_stop_reason": "tool_use"})

    assistant = ChatMessage(role="assistant", blocks=tuple(assemble(first)))
    result = ChatMessage(
        role="user",
        blocks=({"type": "tool_result", "tool_use_id": TOOL_ID, "output": "18°C, sunny"},),
    )
    await collect(thinking_provider.stream(request(question, assistant, result, tools=(WEATHER,))))

    assert len(wire.requests) == 2
    assert wire.requests[1].json["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "thinking",
                    "thinking": "Need the weather.",
                    "signature": fake.SIGNATURE,
                },
                {
                    "type": "tool_use",
                    "id": TOOL_ID,
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "c"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": TOOL_ID,
                    "content": "18°C, sunny",
                    # The newest message's breakpoint: the next call reads this one's cache.
                    "cache_control": {"type": "ephemeral"},
                }
            ],
        },
    ]


async def test_redacted_thinking_goes_back_opaque(
    wire: WireServer, thinking_provider: AnthropicProvider
) -> None:
    wire.queue(
        fake.tool_call_reply(TOOL_ID, "get_time", [], redacted=True, text=["Checking."]),
        fake.text_reply(["Noon."]),
    )

    first = await collect(thinking_provider.stream(request(tools=(CLOCK,))))

    assert first[:2] == [BlockStart(0, "thinking"), BlockStop(0, redacted=fake.REDACTED)]
    blocks = assemble(first)
    assert blocks == [
        {"type": "thinking", "text": "", "redacted": fake.REDACTED},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": TOOL_ID, "name": "get_time", "input": {}},
    ]
    failed = ChatMessage(
        role="user",
        blocks=(
            {"type": "text", "text": "(the clock is broken)"},
            {"type": "tool_result", "tool_use_id": TOOL_ID, "output": None, "error": "ETIMEDOUT"},
        ),
    )
    assistant = ChatMessage(role="assistant", blocks=tuple(blocks))
    await collect(thinking_provider.stream(request(user("Time?"), assistant, failed)))

    messages = wire.requests[1].json["messages"]
    assert messages[1]["content"][0] == {"type": "redacted_thinking", "data": fake.REDACTED}
    # Tool results lead the user message, as the API requires; errors are flagged.
    assert messages[2]["content"] == [
        {"type": "tool_result", "tool_use_id": TOOL_ID, "is_error": True, "content": "ETIMEDOUT"},
        {"type": "text", "text": "(the clock is broken)", "cache_control": {"type": "ephemeral"}},
    ]


async def test_usage_numbers_are_mapped_exactly(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    usage = fake.Usage(
        input_tokens=472,
        output_tokens=89,
        cache_creation_input_tokens=1500,
        cache_read_input_tokens=2048,
    )
    wire.queue(fake.text_reply(["cached"], usage))

    events = await collect(provider.stream(request()))

    reports = [e for e in events if isinstance(e, UsageReport)]
    assert reports == [
        UsageReport(
            input_tokens=472,
            output_tokens=89,
            cache_creation_input_tokens=1500,
            cache_read_input_tokens=2048,
        )
    ]
    assert events[-2:] == [reports[0], Finish("end_turn", {"raw_stop_reason": "end_turn"})]


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("max_tokens", "max_tokens"),
        ("stop_sequence", "stop_sequence"),
        ("model_context_window_exceeded", "max_tokens"),
        ("pause_turn", "end_turn"),
        ("refusal", "end_turn"),
    ],
)
async def test_stop_reasons_are_normalized_and_the_raw_one_kept(
    wire: WireServer, provider: AnthropicProvider, raw: str, normalized: str
) -> None:
    wire.queue(fake.text_reply(["x"], stop_reason=raw))

    events = await collect(provider.stream(request()))

    assert events[-1] == Finish(normalized, {"raw_stop_reason": raw})


# --- failures ---------------------------------------------------------------


async def test_rate_limit_carries_retry_after(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.rate_limited(retry_after="7"))

    events, error = await collect_until_error(provider.stream(request()))

    assert events == []
    assert (error.code, error.status, error.retryable, error.retry_after) == (
        "LLM_RATE_LIMITED",
        429,
        True,
        7.0,
    )


async def test_spend_limit_429_is_not_retried(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.spend_limit_reached(), fake.text_reply(["never"]))

    with pytest.raises(ProviderError) as caught:
        await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))

    assert (caught.value.code, caught.value.retryable) == ("LLM_RATE_LIMITED", False)
    assert caught.value.details is not None
    assert caught.value.details["error_code"] == "enforced_spend_limit_reached"
    assert len(wire.requests) == 1


async def test_429_is_retried_after_retry_after(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.rate_limited(retry_after="1"), fake.text_reply(["after ", "the wait"]))

    started = time.monotonic()
    events = await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))
    elapsed = time.monotonic() - started

    assert len(wire.requests) == 2
    assert elapsed >= 1.0
    assert "".join(e.text for e in events if isinstance(e, TextChunk)) == "after the wait"


@pytest.mark.parametrize(
    "failure", [fake.server_error, fake.overloaded], ids=["500", "529-overloaded"]
)
async def test_server_errors_before_output_are_retried(
    wire: WireServer, provider: AnthropicProvider, failure: Any
) -> None:
    wire.queue(failure(), fake.text_reply(["recovered"]))

    events = await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))

    assert len(wire.requests) == 2
    assert [e.text for e in events if isinstance(e, TextChunk)] == ["recovered"]


async def test_overloaded_is_a_retryable_provider_error(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.overloaded())

    _, error = await collect_until_error(provider.stream(request()))

    assert (error.code, error.status, error.retryable) == ("LLM_PROVIDER_ERROR", 529, True)
    assert error.details is not None and error.details["error_type"] == "overloaded_error"


async def test_context_overflow_is_not_retried(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.context_overflow(), fake.text_reply(["never"]))

    with pytest.raises(ProviderError) as caught:
        await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))

    assert caught.value.code == "CONTEXT_OVERFLOW"
    assert caught.value.status == 400
    assert not caught.value.retryable
    assert "prompt is too long" in caught.value.message
    assert len(wire.requests) == 1


async def test_dropped_connection_mid_stream_interrupts_after_partial_output(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.dropped_midstream(["par", "tial"]), fake.text_reply(["never"]))

    events, error = await collect_until_error(
        stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2)
    )

    assert events == [BlockStart(0, "text"), TextChunk(0, "par"), TextChunk(0, "tial")]
    assert isinstance(error, StreamInterrupted)
    assert error.code == "LLM_PROVIDER_ERROR"
    assert "connection failed" in error.message
    assert error.details is not None and error.details["partial_output"] is True
    assert len(wire.requests) == 1


async def test_error_event_mid_stream_interrupts_after_partial_output(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    wire.queue(fake.error_midstream(["half ", "an answer"]), fake.text_reply(["never"]))

    events, error = await collect_until_error(
        stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2)
    )

    assert [e.text for e in events if isinstance(e, TextChunk)] == ["half ", "an answer"]
    assert isinstance(error, StreamInterrupted)
    assert error.code == "LLM_PROVIDER_ERROR"
    assert error.status == 529
    assert error.details is not None
    assert error.details["error_type"] == "overloaded_error"
    assert error.details["in_stream"] is True
    assert len(wire.requests) == 1


async def test_stream_that_ends_without_message_stop_is_an_error(
    wire: WireServer, provider: AnthropicProvider
) -> None:
    reply = fake.text_reply(["cut"])
    assert reply.events is not None
    reply.events = reply.events[:-2]  # a clean close before message_delta/message_stop
    wire.queue(reply)

    events, error = await collect_until_error(provider.stream(request()))

    assert TextChunk(0, "cut") in events
    assert not any(isinstance(e, UsageReport | Finish) for e in events)
    assert (error.code, error.retryable) == ("LLM_PROVIDER_ERROR", True)
    assert "before message_stop" in error.message


# --- configuration -----------------------------------------------------------


async def test_from_env(wire: WireServer) -> None:
    assert from_env({}) is None
    assert from_env({"ANTHROPIC_BASE_URL": wire.url}) is None

    configured = from_env(
        {
            "ANTHROPIC_API_KEY": "sk-ant-from-env",
            "ANTHROPIC_BASE_URL": wire.url,
            "HOLDFAST_ANTHROPIC_THINKING_BUDGET": "1500",
        }
    )
    assert configured is not None and configured.name == "anthropic"
    wire.queue(fake.text_reply(["hi"]))
    try:
        await collect(configured.stream(request()))
    finally:
        await configured.aclose()

    [sent] = wire.requests
    assert sent.headers["authorization"] == "Bearer sk-ant-from-env"
    assert sent.json["thinking"] == {"type": "enabled", "budget_tokens": 1500}


def test_thinking_budget_below_the_api_minimum_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1024"):
        AnthropicProvider(api_key=API_KEY, thinking_budget=512)
