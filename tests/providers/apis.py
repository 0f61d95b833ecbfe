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
from tests.providers.wire import Reply, WireServer


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


def _anthropic(wire: WireServer) -> WireProvider:
    return AnthropicProvider(api_key="sk-ant-test", base_url=wire.url)


def _openai(wire: WireServer) -> WireProvider:
    return OpenAIProvider(api_key="sk-test", base_url=f"{wire.url}/v1")


def _gemini(wire: WireServer) -> WireProvider:
    return GeminiProvider(api_key="AIza-test", base_url=wire.url)


ANTHROPIC = Api(
    "anthropic",
    fake_anthropic.MODEL,
    _anthropic,
    lambda text: fake_anthropic.text_reply([text]),
    lambda call_id, name, args: fake_anthropic.tool_call_reply(call_id, name, [json.dumps(args)]),
    "messages",
)
OPENAI = Api(
    "openai",
    "gpt-4.1",
    _openai,
    lambda text: fake_openai.text_reply([text]),
    lambda call_id, name, args: fake_openai.tool_calls_reply([(call_id, name, [json.dumps(args)])]),
    "messages",
)
GEMINI = Api(
    "gemini",
    fake_gemini.MODEL,
    _gemini,
    lambda text: fake_gemini.text_reply([text]),
    lambda call_id, name, args: fake_gemini.tool_call_reply(name, args, call_id=call_id),
    "contents",
)
APIS = (ANTHROPIC, OPENAI, GEMINI)

each_api = pytest.mark.parametrize("api", APIS, ids=[api.name for api in APIS])


def assistant(events: list[ModelEvent], provider: str) -> ChatMessage:
    """The assistant message the loop would store from a call's events."""
    return ChatMessage(role="assistant", blocks=tuple(assemble(events)), provider=provider)
