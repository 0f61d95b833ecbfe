"""The OpenAI provider through the real SDK against a local server speaking Chat Completions."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from holdfast_loop_worker.blocks import assemble
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    ModelRequest,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    ToolSpec,
    UsageReport,
)
from holdfast_shared.providers.calls import StreamInterrupted, stream_with_retries
from holdfast_shared.providers.openai import (
    OpenAIProvider,
    default_max_tokens_param,
    from_env,
    parse_retry_after,
)

from tests.providers import fake_openai as fake
from tests.providers.streams import CLOCK, SYSTEM, WEATHER, collect, collect_until_error, user
from tests.providers.wire import Reply, WireServer

pytestmark = pytest.mark.timeout(30)

API_KEY = "sk-proj-test-0123456789"
CALL_ID = "call_12345xyz"


@pytest.fixture
async def provider(wire: WireServer) -> AsyncIterator[OpenAIProvider]:
    p = OpenAIProvider(api_key=API_KEY, base_url=f"{wire.url}/v1")
    yield p
    await p.aclose()


def request(*messages: ChatMessage, tools: tuple[ToolSpec, ...] = ()) -> ModelRequest:
    return ModelRequest(
        model="gpt-4o",
        system=SYSTEM,
        messages=messages or (user("Hello"),),
        tools=tools,
        max_tokens=1024,
    )


def text_of(events: list[ModelEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextChunk))


# --- successful streams ----------------------------------------------------


async def test_plain_text_yields_the_exact_normalized_sequence(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.text_reply(["Hel", "lo, ", "world", "!"], usage_body=fake.usage(21, 5)))

    events = await collect(provider.stream(request()))

    assert events == [
        BlockStart(0, "text"),
        TextChunk(0, "Hel"),
        TextChunk(0, "lo, "),
        TextChunk(0, "world"),
        TextChunk(0, "!"),
        BlockStop(0),
        UsageReport(input_tokens=21, output_tokens=5),
        Finish("end_turn", {"raw_stop_reason": "stop"}),
    ]
    assert text_of(events) == "Hello, world!"


async def test_request_carries_model_limit_system_tools_usage_option_and_key(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.text_reply(["ok"]))

    await collect(provider.stream(request(user("What's the weather?"), tools=(WEATHER, CLOCK))))

    [sent] = wire.requests
    assert sent.method == "POST"
    assert sent.path == "/v1/chat/completions"
    assert sent.headers["authorization"] == f"Bearer {API_KEY}"
    body = sent.json
    assert body["model"] == "gpt-4o"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    # A non-OpenAI base URL gets max_tokens: Ollama and LM Studio read only that.
    assert body["max_tokens"] == 1024
    assert "max_completion_tokens" not in body
    assert body["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What's the weather?"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": WEATHER.input_schema,
            },
        },
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "",
                "parameters": {"type": "object", "properties": {}},
            },
        },
    ]


async def test_no_tools_key_without_tools(provider: OpenAIProvider, wire: WireServer) -> None:
    wire.queue(fake.text_reply(["ok"]))
    await collect(provider.stream(request()))
    assert "tools" not in wire.requests[0].json


async def test_openai_itself_gets_max_completion_tokens(wire: WireServer) -> None:
    assert default_max_tokens_param(None) == "max_completion_tokens"
    assert default_max_tokens_param("https://api.openai.com/v1") == "max_completion_tokens"
    assert default_max_tokens_param("http://localhost:11434/v1") == "max_tokens"

    p = OpenAIProvider(
        api_key=API_KEY, base_url=f"{wire.url}/v1", max_tokens_param="max_completion_tokens"
    )
    wire.queue(fake.text_reply(["ok"]))
    try:
        await collect(p.stream(request()))
    finally:
        await p.aclose()
    body = wire.requests[0].json
    assert body["max_completion_tokens"] == 1024
    assert "max_tokens" not in body


async def test_reasoning_content_is_a_thinking_block_before_the_text(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.thinking_reply(["The user ", "greets me."], ["Hi ", "there."]))

    events = await collect(provider.stream(request()))

    assert events[:9] == [
        BlockStart(0, "thinking"),
        ThinkingChunk(0, "The user "),
        ThinkingChunk(0, "greets me."),
        BlockStop(0),
        BlockStart(1, "text"),
        TextChunk(1, "Hi "),
        TextChunk(1, "there."),
        BlockStop(1),
        UsageReport(input_tokens=19, output_tokens=10),
    ]
    assert events[9] == Finish("end_turn", {"raw_stop_reason": "stop"})


@pytest.mark.parametrize(
    "fields", [("reasoning",), ("reasoning_content", "reasoning")], ids=["reasoning", "both"]
)
async def test_reasoning_field_variants_are_read_once(
    provider: OpenAIProvider, wire: WireServer, fields: tuple[str, ...]
) -> None:
    wire.queue(fake.thinking_reply(["Hmm, ", "ok."], ["Done."], fields=fields))

    events = await collect(provider.stream(request()))

    assert assemble(events) == [
        {"type": "thinking", "text": "Hmm, ok."},
        {"type": "text", "text": "Done."},
    ]


async def test_tool_call_round_trip(provider: OpenAIProvider, wire: WireServer) -> None:
    fragments = ['{"ci', 'ty": "Pa', 'ris", "un', 'it": "c"}']
    wire.queue(
        Reply(
            events=[
                fake.chunk({"role": "assistant", "content": ""}),
                fake.chunk({"reasoning_content": "Need the weather."}),
                *fake.tool_calls_events(
                    [(CALL_ID, "get_weather", fragments)], text=["Let me ", "check."]
                )[1:],
            ]
        )
    )
    first = request(user("Weather in Paris?"), tools=(WEATHER,))

    events = await collect(provider.stream(first))

    assert events[:-2] == [
        BlockStart(0, "thinking"),
        ThinkingChunk(0, "Need the weather."),
        BlockStop(0),
        BlockStart(1, "text"),
        TextChunk(1, "Let me "),
        TextChunk(1, "check."),
        BlockStop(1),
        BlockStart(2, "tool_use", "get_weather", CALL_ID),
        ToolInputChunk(2, '{"ci'),
        ToolInputChunk(2, 'ty": "Pa'),
        ToolInputChunk(2, 'ris", "un'),
        ToolInputChunk(2, 'it": "c"}'),
        BlockStop(2),
    ]
    assert events[-1] == Finish("tool_use", {"raw_stop_reason": "tool_calls"})
    blocks = assemble(events)
    assert blocks == [
        {"type": "thinking", "text": "Need the weather."},
        {"type": "text", "text": "Let me check."},
        {
            "type": "tool_use",
            "id": CALL_ID,
            "name": "get_weather",
            "input": {"city": "Paris", "unit": "c"},
        },
    ]

    wire.queue(fake.text_reply(["It is 18 °C in Paris."]))
    result = {"type": "tool_result", "tool_use_id": CALL_ID, "output": {"temp_c": 18}}
    second = request(
        user("Weather in Paris?"),
        ChatMessage(role="assistant", blocks=tuple(blocks)),
        ChatMessage(role="user", blocks=(result,)),
        tools=(WEATHER,),
    )
    events = await collect(provider.stream(second))

    assert text_of(events) == "It is 18 °C in Paris."
    messages = wire.requests[1].json["messages"]
    assistant, tool = messages[2:]
    # Arguments go back as a JSON string; thinking has no field to go back in.
    arguments = assistant["tool_calls"][0]["function"].pop("arguments")
    assert json.loads(arguments) == {"city": "Paris", "unit": "c"}
    assert assistant == {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [{"id": CALL_ID, "type": "function", "function": {"name": "get_weather"}}],
    }
    assert tool == {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp_c": 18}'}
    assert "Need the weather." not in json.dumps(messages)


async def test_failed_tool_result_is_marked_in_the_tool_message(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.text_reply(["Sorry."]))
    call = {"type": "tool_use", "id": CALL_ID, "name": "get_time", "input": {}}
    result = {
        "type": "tool_result",
        "tool_use_id": CALL_ID,
        "output": "exit status 2",
        "error": "sandbox: command failed",
    }
    await collect(
        provider.stream(
            request(
                user("Time?"),
                ChatMessage(role="assistant", blocks=(call,)),
                ChatMessage(role="user", blocks=(result, {"type": "text", "text": "And now?"})),
            )
        )
    )

    messages = wire.requests[0].json["messages"]
    assert messages[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            }
        ],
    }
    # The tool message comes straight after the call, the user's text after it.
    assert messages[3:] == [
        {
            "role": "tool",
            "tool_call_id": CALL_ID,
            "content": "ERROR: sandbox: command failed\nexit status 2",
        },
        {"role": "user", "content": "And now?"},
    ]


async def test_two_parallel_tool_calls(provider: OpenAIProvider, wire: WireServer) -> None:
    wire.queue(
        fake.tool_calls_reply(
            [
                ("call_paris", "get_weather", ['{"city":', ' "Paris"}']),
                ("call_oslo", "get_weather", ['{"city": "Os', 'lo", "unit": "f"}']),
            ]
        )
    )

    events = await collect(provider.stream(request(tools=(WEATHER,))))

    starts = [e for e in events if isinstance(e, BlockStart)]
    assert starts == [
        BlockStart(0, "tool_use", "get_weather", "call_paris"),
        BlockStart(1, "tool_use", "get_weather", "call_oslo"),
    ]
    assert assemble(events) == [
        {"type": "tool_use", "id": "call_paris", "name": "get_weather", "input": {"city": "Paris"}},
        {
            "type": "tool_use",
            "id": "call_oslo",
            "name": "get_weather",
            "input": {"city": "Oslo", "unit": "f"},
        },
    ]
    # Each block is closed before the next one opens.
    assert events.index(BlockStop(0)) < events.index(starts[1])
    assert events[-1] == Finish("tool_use", {"raw_stop_reason": "tool_calls"})


async def test_ollama_parallel_calls_at_one_index_are_told_apart_by_id(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(
        fake.ollama_parallel_tool_calls_reply(
            [
                ("call_a1", "get_weather", '{"city":"Rome"}'),
                ("call_b2", "get_time", "{}"),
            ],
            # Some compatible servers report "stop" after tool calls.
            finish_reason="stop",
        )
    )

    events = await collect(provider.stream(request(tools=(WEATHER, CLOCK))))

    assert assemble(events) == [
        {"type": "tool_use", "id": "call_a1", "name": "get_weather", "input": {"city": "Rome"}},
        {"type": "tool_use", "id": "call_b2", "name": "get_time", "input": {}},
    ]
    assert events[-1] == Finish("tool_use", {"raw_stop_reason": "stop"})


async def test_usage_numbers_are_mapped_exactly(provider: OpenAIProvider, wire: WireServer) -> None:
    body = fake.usage(2006, 300, cached_tokens=1920, reasoning_tokens=128)
    wire.queue(fake.text_reply(["ok"], usage_body=body))

    events = await collect(provider.stream(request()))

    [report] = [e for e in events if isinstance(e, UsageReport)]
    assert report == UsageReport(
        input_tokens=86,
        output_tokens=300,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=1920,
        reasoning_tokens=128,
    )
    # Exactly one report, just before Finish.
    assert isinstance(events[-2], UsageReport)


@pytest.mark.parametrize(
    ("raw", "normalized", "extra"),
    [
        ("length", "max_tokens", {}),
        ("content_filter", "end_turn", {"content_filter": True}),
    ],
)
async def test_finish_reasons_are_normalized(
    provider: OpenAIProvider, wire: WireServer, raw: str, normalized: str, extra: dict[str, Any]
) -> None:
    wire.queue(fake.text_reply(["cut"], finish_reason=raw))

    events = await collect(provider.stream(request()))

    assert events[-1] == Finish(normalized, {"raw_stop_reason": raw, **extra})


# --- errors and retries ----------------------------------------------------


async def test_rate_limit_with_retry_after_then_success(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.rate_limited(retry_after="1"), fake.text_reply(["after ", "waiting"]))

    started = time.monotonic()
    events = await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))
    elapsed = time.monotonic() - started

    assert len(wire.requests) == 2
    assert elapsed >= 1.0
    assert text_of(events) == "after waiting"


async def test_rate_limit_error_fields(provider: OpenAIProvider, wire: WireServer) -> None:
    wire.queue(fake.rate_limited(retry_after="7"))

    _, error = await collect_until_error(provider.stream(request()))

    assert error.code == "LLM_RATE_LIMITED"
    assert error.retryable is True
    assert error.retry_after == 7.0
    assert error.status == 429
    assert error.details is not None
    assert error.details["code"] == "rate_limit_exceeded"
    assert error.details["request_id"] == "req_ratelimited"


async def test_server_error_before_output_is_retried(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.server_error(), fake.text_reply(["fine now"]))

    events = await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))

    assert len(wire.requests) == 2
    assert text_of(events) == "fine now"


async def test_overloaded_503_is_a_retryable_provider_error(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.overloaded())

    _, error = await collect_until_error(provider.stream(request()))

    assert error.code == "LLM_PROVIDER_ERROR"
    assert error.retryable is True
    assert error.status == 503
    assert "overloaded" in error.message


@pytest.mark.parametrize(
    "reply",
    [fake.context_length_exceeded, fake.vllm_context_length_exceeded],
    ids=["openai", "vllm"],
)
async def test_context_overflow_is_not_retried(
    provider: OpenAIProvider, wire: WireServer, reply: Any
) -> None:
    wire.queue(reply(), fake.text_reply(["never sent"]))

    _, error = await collect_until_error(
        stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2)
    )

    assert error.code == "CONTEXT_OVERFLOW"
    assert error.retryable is False
    assert error.status == 400
    assert not isinstance(error, StreamInterrupted)
    assert len(wire.requests) == 1


async def test_error_event_mid_stream_interrupts_after_partial_output(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.error_mid_stream(["Partial ", "answer"]), fake.text_reply(["never"]))

    events, error = await collect_until_error(
        stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2)
    )

    assert events == [BlockStart(0, "text"), TextChunk(0, "Partial "), TextChunk(0, "answer")]
    assert isinstance(error, StreamInterrupted)
    assert error.code == "LLM_PROVIDER_ERROR"
    assert "server had an error" in error.message
    assert len(wire.requests) == 1


# The SDK reads a dropped stream through nested async generators (httpx's
# aiter_raw under its own decoder) that it closes only by garbage collection;
# on a loaded machine the collector finalizes one while the server side is
# still tearing down, and pytest reports that as an unraisable exception.
# Not ours: the provider closes the response (``async with chunks``).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_dropped_connection_mid_stream_interrupts(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.dropped_mid_stream(["one ", "two ", "three"]), fake.text_reply(["never"]))

    events, error = await collect_until_error(
        stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2)
    )

    assert text_of(events) == "one two three"
    assert isinstance(error, StreamInterrupted)
    assert error.code == "LLM_PROVIDER_ERROR"
    assert len(wire.requests) == 1


# The SDK reads a dropped stream through nested async generators (httpx's
# aiter_raw under its own decoder) that it closes only by garbage collection;
# on a loaded machine the collector finalizes one while the server side is
# still tearing down, and pytest reports that as an unraisable exception.
# Not ours: the provider closes the response (``async with chunks``).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_dropped_connection_is_a_retryable_error(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.dropped_mid_stream(["one"]))

    events, error = await collect_until_error(provider.stream(request()))

    assert text_of(events) == "one"
    assert error.code == "LLM_PROVIDER_ERROR"
    assert error.retryable is True


async def test_error_event_before_any_output_is_retried(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.error_mid_stream([]), fake.text_reply(["recovered"]))

    events = await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))

    assert len(wire.requests) == 2
    assert text_of(events) == "recovered"


async def test_body_ending_without_finish_reason_is_an_error(
    provider: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.ended_without_finish(["half an "]))

    events, error = await collect_until_error(provider.stream(request()))

    assert text_of(events) == "half an "
    assert error.code == "LLM_PROVIDER_ERROR"
    assert error.retryable is True
    assert not any(isinstance(e, Finish) for e in events)


def test_retry_after_header_forms() -> None:
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "3"}) == 0.25
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0
    assert parse_retry_after({}) is None


# --- configuration ---------------------------------------------------------


async def test_from_env(wire: WireServer) -> None:
    assert from_env({}) is None
    assert from_env({"OPENAI_API_KEY": ""}) is None
    keyed = from_env({"OPENAI_API_KEY": API_KEY})
    assert isinstance(keyed, OpenAIProvider)
    await keyed.aclose()

    # A base URL alone (Ollama) works with the placeholder key.
    local = from_env({"OPENAI_BASE_URL": f"{wire.url}/v1"})
    assert local is not None
    wire.queue(fake.text_reply(["local"]))
    try:
        events = await collect(local.stream(request()))
    finally:
        await local.aclose()
    assert text_of(events) == "local"
    assert wire.requests[0].headers["authorization"] == "Bearer unused"
    assert wire.requests[0].path == "/v1/chat/completions"


async def test_no_base_url_means_the_sdk_default(
    wire: WireServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The SDK's default honours its own OPENAI_BASE_URL lookup; the limit
    # parameter follows the URL actually used.
    monkeypatch.setenv("OPENAI_BASE_URL", f"{wire.url}/v1")
    p = OpenAIProvider(api_key=API_KEY)
    wire.queue(fake.text_reply(["ok"]))
    try:
        await collect(p.stream(request()))
    finally:
        await p.aclose()
    assert wire.requests[0].json["max_tokens"] == 1024
