"""The three wire APIs behind one face, for tests that run one scenario against each.

An :class:`Api` builds its provider against a :class:`WireServer` and the
replies of its fake (a text answer, a tool call), and knows where its
request body keeps the conversation, so a test can drive a task the same
way against Anthropic, OpenAI and Gemini and read what each server got.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
from holdfast_loop_worker.blocks import assemble
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers.anthropic import AnthropicProvider
from holdfast_shared.providers.base import ModelEvent, ModelRequest
from holdfast_shared.providers.gemini import GeminiProvider
from holdfast_shared.providers.openai import OpenAIProvider

from tests.providers import fake_anthropic, fake_gemini, fake_openai
from tests.providers.wire import SSE, Reply, WireServer


class WireProvider(Protocol):
    name: str

    def stream(self, request: ModelRequest) -> Any: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Api:
    name: str
    model: str
    connect: Callable[[WireServer], WireProvider]
    text: Callable[[str], Reply]
    # (call id, tool name, input) → a reply asking for that one call
    tool_call: Callable[[str, str, dict[str, Any]], Reply]
    # Where the body keeps the conversation: "messages" or "contents".
    conversation: str
    # A text answer streamed as one delta per part.
    answer: Callable[[list[str]], Reply]
    # 429 with ``retry-after`` (seconds, as sent).
    rate_limited: Callable[[str], Reply]
    # 429 with the API's own hint of the wait (seconds): ``retry-after-ms``
    # (Anthropic, OpenAI) or a RetryInfo ``retryDelay`` in the body (Gemini).
    hinted: Callable[[float], Reply]
    # The API's "overloaded": Anthropic's 529, OpenAI's and Gemini's 503.
    overloaded: Callable[[], Reply]
    # A text answer whose usage says the prompt was this many tokens.
    reporting: Callable[[list[str], int], Reply]
    # These text deltas, then the API's own 500 error event inside the 200 stream.
    error_mid_stream: Callable[[list[str]], Reply]
    # 429 whose only hint is the rate-limit headers: the request limit used up,
    # reset in this many seconds (Gemini has none: its RetryInfo instead).
    reset_hinted: Callable[[float], Reply]


def _anthropic(wire: WireServer) -> WireProvider:
    return AnthropicProvider(api_key="sk-ant-test", base_url=wire.url)


def _openai(wire: WireServer) -> WireProvider:
    return OpenAIProvider(api_key="sk-test", base_url=f"{wire.url}/v1")


def _gemini(wire: WireServer) -> WireProvider:
    return GeminiProvider(api_key="AIza-test", base_url=wire.url)


def _with_header(reply: Reply, seconds: float) -> Reply:
    """``reply`` with ``retry-after-ms``, which the SDKs read before ``retry-after``."""
    reply.headers["retry-after-ms"] = str(int(seconds * 1000))
    return reply


ANTHROPIC = Api(
    "anthropic",
    fake_anthropic.MODEL,
    _anthropic,
    lambda text: fake_anthropic.text_reply([text]),
    lambda call_id, name, args: fake_anthropic.tool_call_reply(call_id, name, [json.dumps(args)]),
    "messages",
    fake_anthropic.text_reply,
    fake_anthropic.rate_limited,
    lambda seconds: _with_header(fake_anthropic.rate_limited("60"), seconds),
    fake_anthropic.overloaded,
    lambda parts, n: fake_anthropic.text_reply(parts, fake_anthropic.Usage(input_tokens=n)),
    lambda parts: fake_anthropic.error_midstream(parts, "api_error"),
    fake_anthropic.rate_limit_used_up,
)
OPENAI = Api(
    "openai",
    "gpt-4.1",
    _openai,
    lambda text: fake_openai.text_reply([text]),
    lambda call_id, name, args: fake_openai.tool_calls_reply([(call_id, name, [json.dumps(args)])]),
    "messages",
    fake_openai.text_reply,
    fake_openai.rate_limited,
    lambda seconds: _with_header(fake_openai.rate_limited(None), seconds),
    fake_openai.overloaded,
    lambda parts, n: fake_openai.text_reply(parts, usage_body=fake_openai.usage(n)),
    fake_openai.error_mid_stream,
    fake_openai.rate_limit_used_up,
)
GEMINI = Api(
    "gemini",
    fake_gemini.MODEL,
    _gemini,
    lambda text: fake_gemini.text_reply([text]),
    lambda call_id, name, args: fake_gemini.tool_call_reply(name, args, call_id=call_id),
    "contents",
    fake_gemini.text_reply,
    lambda seconds: fake_gemini.rate_limited(retry_after=seconds),
    lambda seconds: fake_gemini.rate_limited(retry_after=None, retry_delay=f"{seconds}s"),
    fake_gemini.overloaded,
    lambda parts, n: fake_gemini.text_reply(parts, prompt=n),
    fake_gemini.error_mid_stream,
    lambda seconds: fake_gemini.rate_limited(retry_after=None, retry_delay=f"{seconds}s"),
)
APIS = (ANTHROPIC, OPENAI, GEMINI)

each_api = pytest.mark.parametrize("api", APIS, ids=[api.name for api in APIS])


def cut_at(reply: Reply, marker: str, *, inside: bool = False) -> Reply:
    """``reply`` with its connection reset before the first event that carries
    ``marker`` (``inside``: halfway through that event's line, mid-JSON)."""
    assert reply.events is not None
    index = next(i for i, e in enumerate(reply.events) if marker.encode() in e.encode())
    reply.break_after = index
    if inside:
        reply.break_inside = reply.events[index].encode().index(marker.encode()) + 2
    return reply


def garbled(reply: Reply, marker: str, garbage: SSE) -> Reply:
    """``reply`` with ``garbage`` sent just before the first event carrying ``marker``."""
    assert reply.events is not None
    index = next(i for i, e in enumerate(reply.events) if marker.encode() in e.encode())
    reply.events.insert(index, garbage)
    return reply


def without_usage(reply: Reply) -> Reply:
    """``reply`` with every usage figure left out, as llama.cpp's server sends it."""
    assert reply.events is not None
    reply.events = [SSE(_unused(e.data), e.event) for e in reply.events]
    return reply


def _unused(data: Any) -> Any:
    if not isinstance(data, dict):
        return data
    return {k: _unused(v) for k, v in data.items() if k not in ("usage", "usageMetadata")}


def endless(reply: Reply, marker: str, every: float = 0.02) -> Reply:
    """``reply`` up to the first event carrying ``marker``, then that event again
    and again: a stream that never sends its stop."""
    assert reply.events is not None
    index = next(i for i, e in enumerate(reply.events) if marker.encode() in e.encode())
    reply.endless = reply.events[index]
    reply.events = reply.events[: index + 1]
    reply.delay_between = every
    return reply


def assistant(events: list[ModelEvent], provider: str) -> ChatMessage:
    """The assistant message the loop would store from a call's events."""
    return ChatMessage(role="assistant", blocks=tuple(assemble(events)), provider=provider)
