"""The Gemini provider through the real google-genai SDK against a local wire-format server."""

from __future__ import annotations

import base64
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
    ProviderError,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    UsageReport,
)
from holdfast_shared.providers.calls import StreamInterrupted, stream_with_retries
from holdfast_shared.providers.gemini import GeminiProvider, from_env

from tests.providers import fake_gemini as fake
from tests.providers.streams import SYSTEM, WEATHER, collect, user
from tests.providers.wire import Recorded, WireServer

pytestmark = pytest.mark.timeout(30)

API_KEY = "AIzaSyTest-0123456789abcdefghijklmnop"
MODEL = fake.MODEL


@pytest.fixture
async def provider(wire: WireServer) -> AsyncIterator[GeminiProvider]:
    p = GeminiProvider(api_key=API_KEY, base_url=wire.url)
    yield p
    await p.aclose()


def request(*messages: ChatMessage, model: str = MODEL, **kwargs: Any) -> ModelRequest:
    return ModelRequest(model=model, system=SYSTEM, messages=messages or (user("Hello"),), **kwargs)


def tuple_blocks(events: list[ModelEvent]) -> tuple[dict[str, Any], ...]:
    return tuple(assemble(events))


def only(wire: WireServer) -> Recorded:
    assert len(wire.requests) == 1
    return wire.requests[0]


# --- the stream ----------------------------------------------------------------


async def test_plain_text_streams_one_text_block(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.text_reply(["Hello", ", wor", "ld!"], prompt=12, output=4))

    events = await collect(provider.stream(request()))

    assert events == [
        BlockStart(0, "text"),
        TextChunk(0, "Hello"),
        TextChunk(0, ", wor"),
        TextChunk(0, "ld!"),
        BlockStop(0),
        UsageReport(input_tokens=12, output_tokens=4),
        Finish("end_turn", {"raw_stop_reason": "STOP"}),
    ]
    assert "".join(e.text for e in events if isinstance(e, TextChunk)) == "Hello, world!"


async def test_thought_parts_become_a_thinking_block_before_the_text(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(
        fake.thinking_reply(
            ["**Weighing it** The user ", "wants a greeting."], ["Hi ", "there."], thought_tokens=31
        )
    )

    events = await collect(provider.stream(request()))

    assert events[:8] == [
        BlockStart(0, "thinking"),
        ThinkingChunk(0, "**Weighing it** The user "),
        ThinkingChunk(0, "wants a greeting."),
        BlockStop(0),
        BlockStart(1, "text"),
        TextChunk(1, "Hi "),
        TextChunk(1, "there."),
        # The signature came on the last (empty) text part: it signs the text.
        BlockStop(1, signature=fake.SIGNATURE),
    ]
    assert events[8] == UsageReport(input_tokens=20, output_tokens=7, reasoning_tokens=31)
    assert events[9] == Finish("end_turn", {"raw_stop_reason": "STOP"})
    # Thought summaries were asked for.
    config = only(wire).json["generationConfig"]
    thinking = config["thinkingConfig"]
    assert thinking.get("includeThoughts", thinking.get("include_thoughts")) is True


async def test_tool_call_round_trip_sends_the_result_and_the_signature_back(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(
        fake.tool_call_reply(
            "get_weather",
            {"city": "Paris", "unit": "c"},
            thoughts=["Need the weather tool."],
            thought_tokens=12,
        )
    )
    first = request(user("Weather in Paris?"), tools=(WEATHER,))

    events = await collect(provider.stream(first))

    start = events[3]
    assert isinstance(start, BlockStart) and start.block_type == "tool_use"
    assert start.tool_name == "get_weather"
    assert start.tool_call_id is not None and start.tool_call_id.startswith("call_")
    assert events[:4] == [
        BlockStart(0, "thinking"),
        ThinkingChunk(0, "Need the weather tool."),
        BlockStop(0),
        start,
    ]
    inputs = [e.partial_json for e in events if isinstance(e, ToolInputChunk)]
    assert json.loads("".join(inputs)) == {"city": "Paris", "unit": "c"}
    assert events[5] == BlockStop(1, signature=fake.SIGNATURE)
    assert events[-1] == Finish("tool_use", {"raw_stop_reason": "STOP"})

    # The loop stores the answer and the tool's result, then calls again.
    assistant = ChatMessage(role="assistant", blocks=tuple_blocks(events))
    result = ChatMessage(
        role="user",
        blocks=(
            {"type": "tool_result", "tool_use_id": start.tool_call_id, "output": "18°C, clear"},
        ),
    )
    wire.queue(fake.text_reply(["It is 18°C and clear."]))
    second = request(user("Weather in Paris?"), assistant, result, tools=(WEATHER,))
    await collect(provider.stream(second))

    contents = wire.requests[1].json["contents"]
    assert [c["role"] for c in contents] == ["user", "model", "user"]
    # The unsigned thought summary is not replayed; the signed call is, verbatim.
    assert contents[1]["parts"] == [
        {
            "functionCall": {"name": "get_weather", "args": {"city": "Paris", "unit": "c"}},
            "thoughtSignature": _wire_signature(fake.SIGNATURE),
        }
    ]
    # Our invented id stays local: Gemini matches the response by name.
    assert contents[2]["parts"] == [
        {"functionResponse": {"name": "get_weather", "response": {"output": "18°C, clear"}}}
    ]


async def test_call_ids_from_gemini_are_kept_and_sent_back(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.tool_call_reply("get_weather", {"city": "Oslo"}, call_id="fc_7f3a9c2e"))
    events = await collect(provider.stream(request(tools=(WEATHER,))))
    assert events[0] == BlockStart(
        0, "tool_use", tool_name="get_weather", tool_call_id="fc_7f3a9c2e"
    )

    failed = ChatMessage(
        role="user",
        blocks=(
            {
                "type": "tool_result",
                "tool_use_id": "fc_7f3a9c2e",
                "output": None,
                "error": "city not found",
            },
        ),
    )
    wire.queue(fake.text_reply(["Sorry."]))
    assistant = ChatMessage(role="assistant", blocks=tuple_blocks(events))
    await collect(provider.stream(request(user("Hi"), assistant, failed, tools=(WEATHER,))))

    contents = wire.requests[1].json["contents"]
    assert contents[1]["parts"][0]["functionCall"]["id"] == "fc_7f3a9c2e"
    assert contents[2]["parts"] == [
        {
            "functionResponse": {
                "id": "fc_7f3a9c2e",
                "name": "get_weather",
                "response": {"error": "city not found"},
            }
        }
    ]


async def test_parallel_calls_become_one_block_each(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(
        fake.parallel_calls_reply(
            [("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Oslo"})]
        )
    )

    events = await collect(provider.stream(request(tools=(WEATHER,))))

    starts = [e for e in events if isinstance(e, BlockStart)]
    assert [(s.index, s.block_type) for s in starts] == [(0, "tool_use"), (1, "tool_use")]
    assert starts[0].tool_call_id != starts[1].tool_call_id
    assert [e for e in events if isinstance(e, BlockStop)] == [
        BlockStop(0, signature=fake.SIGNATURE),
        BlockStop(1),
    ]
    assert events[-1] == Finish("tool_use", {"raw_stop_reason": "STOP"})


async def test_a_lost_signature_is_stubbed_for_gemini_3(
    wire: WireServer, provider: GeminiProvider
) -> None:
    # History as a loop that drops tool_use signatures would store it.
    assistant = ChatMessage(
        role="assistant",
        blocks=(
            {"type": "tool_use", "id": "fc_1", "name": "get_weather", "input": {"city": "Rome"}},
        ),
    )
    result = ChatMessage(
        role="user", blocks=({"type": "tool_result", "tool_use_id": "fc_1", "output": "sunny"},)
    )
    wire.queue(fake.text_reply(["Sunny."]), fake.text_reply(["Sunny."]))

    await collect(
        provider.stream(request(user("Hi"), assistant, result, model="gemini-3-pro-preview"))
    )
    await collect(provider.stream(request(user("Hi"), assistant, result, model=MODEL)))

    gemini_3, gemini_2 = (r.json["contents"][1]["parts"][0] for r in wire.requests)
    assert gemini_3["thoughtSignature"] == "skip_thought_signature_validator"
    assert "thoughtSignature" not in gemini_2


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("MAX_TOKENS", "max_tokens"), ("SAFETY", "end_turn"), ("RECITATION", "end_turn")],
)
async def test_finish_reasons_are_normalized_and_kept_raw(
    wire: WireServer, provider: GeminiProvider, raw: str, expected: str
) -> None:
    wire.queue(fake.text_reply(["Cut"], finish_reason=raw))
    events = await collect(provider.stream(request()))
    assert events[-1] == Finish(expected, {"raw_stop_reason": raw})


async def test_a_blocked_prompt_ends_the_turn_with_its_reason(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.blocked_prompt("PROHIBITED_CONTENT"))
    events = await collect(provider.stream(request()))
    assert events == [
        UsageReport(input_tokens=8),
        Finish("end_turn", {"raw_stop_reason": "PROHIBITED_CONTENT", "prompt_blocked": True}),
    ]


async def test_usage_is_mapped_exactly(wire: WireServer, provider: GeminiProvider) -> None:
    wire.queue(fake.text_reply(["a", "b"], prompt=2_000, output=57, cached=1_536))

    events = await collect(provider.stream(request()))

    # promptTokenCount includes the cached part; only the last running total counts.
    assert [e for e in events if isinstance(e, UsageReport)] == [
        UsageReport(
            input_tokens=464,
            output_tokens=57,
            cache_read_input_tokens=1_536,
            cache_creation_input_tokens=0,
            reasoning_tokens=0,
        )
    ]


# --- the request ---------------------------------------------------------------


async def test_request_carries_model_limits_system_tools_and_key(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.text_reply(["ok"]))

    await collect(provider.stream(request(tools=(WEATHER,), max_tokens=321)))

    sent = only(wire)
    assert sent.path == f"/v1beta/models/{MODEL}:streamGenerateContent"
    assert sent.query == "alt=sse"
    assert sent.headers["x-goog-api-key"] == API_KEY
    body = sent.json
    assert body["contents"] == [{"role": "user", "parts": [{"text": "Hello"}]}]
    assert body["systemInstruction"]["parts"] == [{"text": SYSTEM}]
    assert body["generationConfig"]["maxOutputTokens"] == 321
    [declaration] = body["tools"][0]["functionDeclarations"]
    assert declaration["name"] == "get_weather"
    assert declaration["description"] == "Current weather for a city."
    # The SDK sends this field snake_case; the API accepts either spelling.
    schema = declaration.get("parametersJsonSchema", declaration.get("parameters_json_schema"))
    assert schema == WEATHER.input_schema


async def test_signed_thinking_goes_back_as_a_thought_part(
    wire: WireServer, provider: GeminiProvider
) -> None:
    signature = base64.b64encode(b"\xfb\xff-signed thought-\xfe").decode()
    assistant = ChatMessage(
        role="assistant",
        blocks=(
            {"type": "thinking", "text": "Plan.", "signature": signature},
            {"type": "thinking", "text": "Unsigned summary."},
            {"type": "text", "text": "Done."},
        ),
    )
    wire.queue(fake.text_reply(["ok"]))

    await collect(provider.stream(request(user("Hi"), assistant, user("And?"))))

    model_turn = only(wire).json["contents"][1]
    assert model_turn == {
        "role": "model",
        "parts": [
            {"text": "Plan.", "thought": True, "thoughtSignature": _wire_signature(signature)},
            {"text": "Done."},
        ],
    }


def test_from_env_needs_a_key() -> None:
    assert from_env({}) is None
    assert from_env({"GEMINI_API_KEY": ""}) is None
    assert isinstance(from_env({"GOOGLE_API_KEY": "k"}), GeminiProvider)
    assert isinstance(
        from_env({"GEMINI_API_KEY": "k", "HOLDFAST_GEMINI_BASE_URL": "http://x"}), GeminiProvider
    )


async def test_env_key_and_base_url_reach_the_server(wire: WireServer) -> None:
    provider = from_env({"GEMINI_API_KEY": "env-key", "HOLDFAST_GEMINI_BASE_URL": wire.url})
    assert provider is not None
    wire.queue(fake.text_reply(["ok"]))
    try:
        await collect(provider.stream(request()))
    finally:
        await provider.aclose()
    assert only(wire).headers["x-goog-api-key"] == "env-key"


# --- failures ------------------------------------------------------------------


async def test_rate_limit_waits_retry_after_then_succeeds(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.rate_limited(retry_after="1"), fake.text_reply(["Back."]))

    started = time.monotonic()
    events = await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))

    assert time.monotonic() - started >= 1.0
    assert len(wire.requests) == 2
    assert [e.text for e in events if isinstance(e, TextChunk)] == ["Back."]


async def test_rate_limit_error_carries_gemini_retry_info(
    wire: WireServer, provider: GeminiProvider
) -> None:
    # Gemini itself sends no retry-after header: the wait is in the body.
    wire.queue(fake.rate_limited(retry_after=None, retry_delay="1.5s"))

    with pytest.raises(ProviderError) as caught:
        await collect(provider.stream(request()))

    error = caught.value
    assert (error.code, error.status, error.retryable) == ("LLM_RATE_LIMITED", 429, True)
    assert error.retry_after == 1.5


async def test_server_error_before_output_is_retried(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.server_error(), fake.text_reply(["Recovered."]))

    events = await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))

    assert len(wire.requests) == 2
    assert [e.text for e in events if isinstance(e, TextChunk)] == ["Recovered."]


async def test_overloaded_is_retryable(wire: WireServer, provider: GeminiProvider) -> None:
    wire.queue(fake.overloaded())

    with pytest.raises(ProviderError) as caught:
        await collect(provider.stream(request()))

    error = caught.value
    assert (error.code, error.status, error.retryable) == ("LLM_PROVIDER_ERROR", 503, True)
    assert error.details == {"provider_status": "UNAVAILABLE"}


async def test_context_overflow_is_not_retried(wire: WireServer, provider: GeminiProvider) -> None:
    wire.queue(fake.context_overflow(), fake.text_reply(["never"]))

    with pytest.raises(ProviderError) as caught:
        await collect(stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2))

    error = caught.value
    assert (error.code, error.status, error.retryable) == ("CONTEXT_OVERFLOW", 400, False)
    assert "exceeds the maximum number of tokens" in error.message
    assert len(wire.requests) == 1


async def test_error_event_mid_stream_interrupts_after_partial_output(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.error_mid_stream(["Partial ", "answer"]), fake.text_reply(["never"]))
    seen: list[ModelEvent] = []

    with pytest.raises(StreamInterrupted) as caught:
        async for event in stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2):
            seen.append(event)

    assert seen == [BlockStart(0, "text"), TextChunk(0, "Partial "), TextChunk(0, "answer")]
    assert caught.value.code == "LLM_PROVIDER_ERROR"
    assert caught.value.status == 500
    assert len(wire.requests) == 1


async def test_dropped_connection_mid_stream_interrupts(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.dropped_mid_stream(["Half ", "way"]), fake.text_reply(["never"]))
    seen: list[ModelEvent] = []

    with pytest.raises(StreamInterrupted) as caught:
        async for event in stream_with_retries(provider, request(), initial_wait=0.01, max_wait=2):
            seen.append(event)

    assert seen == [BlockStart(0, "text"), TextChunk(0, "Half "), TextChunk(0, "way")]
    assert caught.value.code == "LLM_PROVIDER_ERROR"
    assert len(wire.requests) == 1


async def test_stream_without_finish_reason_is_an_error(
    wire: WireServer, provider: GeminiProvider
) -> None:
    wire.queue(fake.cut_short(["Trunc"]))

    with pytest.raises(ProviderError) as caught:
        await collect(provider.stream(request()))

    assert caught.value.retryable


async def test_read_timeout_is_retryable(wire: WireServer) -> None:
    provider = GeminiProvider(api_key=API_KEY, base_url=wire.url, timeout=0.3)
    slow = fake.text_reply(["late"])
    slow.delay_between = 1.0
    wire.queue(slow)
    try:
        with pytest.raises(ProviderError) as caught:
            await collect(provider.stream(request()))
    finally:
        await provider.aclose()

    assert caught.value.retryable
    assert "Timeout" in caught.value.message


async def test_connection_refused_is_retryable() -> None:
    closed = WireServer()  # never started: nothing listens on its port
    provider = GeminiProvider(api_key=API_KEY, base_url=closed.url)
    try:
        with pytest.raises(ProviderError) as caught:
            await collect(provider.stream(request()))
    finally:
        await provider.aclose()

    assert (caught.value.code, caught.value.retryable) == ("LLM_PROVIDER_ERROR", True)


def _wire_signature(signature: str) -> str:
    """How the SDK re-encodes a signature's bytes on the wire (URL-safe base64)."""
    return base64.urlsafe_b64encode(base64.b64decode(signature)).decode()
