"""Tool calls and results are never sent split: the APIs refuse it, so the providers mend it.

Each wire server refuses a split pair with the real API's 400 (checked here
through each SDK directly). A stored history can hold one — a turn cancelled
or cut off after the model asked for a tool stores the call and never its
result — so ``toolpairs.paired`` mends it before any provider renders it,
and every provider's request passes its server's check.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from google import genai
from google.genai import errors, types
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers.base import ModelRequest
from holdfast_shared.providers.toolpairs import NOT_RUN, paired

from tests.providers import fake_anthropic, fake_gemini
from tests.providers.apis import Api, each_api
from tests.providers.streams import SYSTEM, WEATHER, collect, user
from tests.providers.wire import WireServer

pytestmark = pytest.mark.timeout(30)


def call(call_id: str, name: str = "get_weather") -> ChatMessage:
    block = {"type": "tool_use", "id": call_id, "name": name, "input": {"city": "Oslo"}}
    return ChatMessage("assistant", (block,))


def answer(call_id: str, output: str = "4°C") -> ChatMessage:
    return ChatMessage("user", ({"type": "tool_result", "tool_use_id": call_id, "output": output},))


def not_run(call_id: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "output": None, "error": NOT_RUN}


# --- paired(): the mending, without a server --------------------------------


def test_a_whole_history_is_left_as_it_is() -> None:
    history = [user("Weather?"), call("c1"), answer("c1"), user("Thanks.")]
    assert paired(history) == history


def test_a_call_without_result_is_answered_first_in_the_next_user_message() -> None:
    history = [user("Weather?"), call("c1"), user("Never mind.")]

    mended = paired(history)

    assert mended[:2] == history[:2]
    assert mended[2].blocks == (not_run("c1"), {"type": "text", "text": "Never mind."})


def test_a_call_followed_by_another_model_message_gets_a_user_message_of_its_own() -> None:
    reply = ChatMessage("assistant", ({"type": "text", "text": "Hm."},))
    mended = paired([user("Weather?"), call("c1"), reply])

    assert [m.role for m in mended] == ["user", "assistant", "user", "assistant"]
    assert mended[2].blocks == (not_run("c1"),)


def test_a_call_at_the_end_is_answered_at_the_end() -> None:
    mended = paired([user("Weather?"), call("c1")])
    assert mended[-1] == ChatMessage("user", (not_run("c1"),))


def test_a_result_with_no_call_before_it_is_left_out() -> None:
    history = [user("Weather?"), answer("c9"), call("c1"), answer("c1"), answer("c1")]

    mended = paired(history)

    # The stray result and the repeated answer (a second user message) are gone.
    assert mended == [user("Weather?"), call("c1"), answer("c1")]


def test_mending_is_the_same_on_every_call() -> None:
    # A prompt cache needs the mended history to stay what it was as the task grows.
    history = [user("Weather?"), call("c1"), user("Never mind.")]
    longer = [*history, ChatMessage("assistant", ({"type": "text", "text": "OK."},))]
    assert paired(longer)[: len(history)] == paired(history)


# --- the servers refuse a split pair, as the APIs do -------------------------


async def test_the_anthropic_server_refuses_a_split_pair(wire: WireServer) -> None:
    client = anthropic.AsyncAnthropic(api_key="k", base_url=wire.url, max_retries=0)
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "4°C"}
    unanswered: list[Any] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": "Never mind."},
    ]
    stray: list[Any] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me see."},
        {"role": "user", "content": [result]},
    ]
    try:
        for messages, says in [(unanswered, "without `tool_result`"), (stray, "unexpected")]:
            with pytest.raises(anthropic.BadRequestError) as caught:
                await client.messages.create(
                    model=fake_anthropic.MODEL, max_tokens=16, messages=messages
                )
            assert caught.value.status_code == 400
            assert says in caught.value.message
    finally:
        await client.close()


async def test_the_openai_server_refuses_a_split_pair(wire: WireServer) -> None:
    client = openai.AsyncOpenAI(api_key="k", base_url=f"{wire.url}/v1", max_retries=0)
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    unanswered: list[Any] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [tool_call]},
        {"role": "user", "content": "Never mind."},
    ]
    stray: list[Any] = [
        {"role": "user", "content": "Weather?"},
        {"role": "tool", "tool_call_id": "call_1", "content": "4°C"},
    ]
    try:
        for messages, says in [(unanswered, "did not have response"), (stray, "role 'tool'")]:
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="gpt-4.1", messages=messages)
            assert caught.value.status_code == 400
            assert says in caught.value.message
    finally:
        await client.close()


async def test_the_gemini_server_refuses_a_split_pair(wire: WireServer) -> None:
    client = genai.Client(
        api_key="k",
        http_options=types.HttpOptions(
            base_url=wire.url,
            api_version="v1beta",
            retry_options=types.HttpRetryOptions(attempts=1),
        ),
    )
    function_call = types.Part(function_call=types.FunctionCall(name="get_weather", args={}))
    function_response = types.Part(
        function_response=types.FunctionResponse(name="get_weather", response={"output": "4°C"})
    )
    unanswered = [
        types.Content(role="user", parts=[types.Part(text="Weather?")]),
        types.Content(role="model", parts=[function_call]),
        types.Content(role="user", parts=[types.Part(text="Never mind.")]),
    ]
    stray = [
        types.Content(role="user", parts=[types.Part(text="Weather?")]),
        types.Content(role="user", parts=[function_response]),
    ]
    try:
        for contents, says in [
            (unanswered, "number of function response"),
            (stray, "response turn"),
        ]:
            with pytest.raises(errors.ClientError) as caught:
                await client.aio.models.generate_content(
                    model=fake_gemini.MODEL, contents=list(contents)
                )
            assert caught.value.code == 400
            assert says in (caught.value.message or "")
    finally:
        await client.aio.aclose()


# --- and no provider sends one ---------------------------------------------


@each_api
async def test_a_split_history_goes_out_mended(wire: WireServer, api: Api) -> None:
    provider = api.connect(wire)
    wire.queue(api.text("ok"))
    history = (
        user("Weather in Oslo?"),
        ChatMessage(
            "assistant",
            ({"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}},),
            provider=api.name,
        ),
        # The turn was cancelled here: no result was stored. Then a stray one.
        user("Never mind. What about Rome?"),
        answer("call_0"),
    )
    request = ModelRequest(model=api.model, system=SYSTEM, messages=history, tools=(WEATHER,))

    await collect(provider.stream(request))
    await provider.aclose()

    [sent] = wire.requests
    body = str(sent.json[api.conversation])
    assert NOT_RUN in body
    assert "call_0" not in body
