"""Structured output (``output_schema``, #27) through each provider's real SDK
against its wire server: the native request reaches the wire (Anthropic: a
forced ``final_result`` tool; OpenAI: ``response_format`` ``json_schema``;
Gemini: ``responseMimeType`` and ``responseJsonSchema``), and the model's
native answer comes back as the call's text, which validates against the
schema (the loop-worker's own check, ``turn/result.py``)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from holdfast_loop_worker.blocks import assemble
from holdfast_loop_worker.turn.result import check
from holdfast_shared.providers.anthropic import AnthropicProvider
from holdfast_shared.providers.base import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    ModelRequest,
    TextChunk,
    UsageReport,
)
from holdfast_shared.providers.scripted import ScriptedProvider
from holdfast_shared.providers.structured import OUTPUT_TOOL

from tests.providers import fake_anthropic, fake_gemini, fake_openai
from tests.providers.apis import ANTHROPIC, GEMINI, OPENAI, Api
from tests.providers.streams import SYSTEM, WEATHER, collect, user
from tests.providers.wire import SSE, Recorded, Reply, WireServer

pytestmark = pytest.mark.timeout(30)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "temperature": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "temperature"],
    "additionalProperties": False,
}
ANSWER = {"city": "Oslo", "temperature": -3.5, "tags": ["snow"]}
# The answer as a model streams it: JSON cut anywhere.
PARTS = ['{"city": "Os', 'lo", "tempera', 'ture": -3.5, "tags": ["snow"]}']


def request(api: Api, **kw: Any) -> ModelRequest:
    base = ModelRequest(
        model=api.model,
        system=SYSTEM,
        messages=(user("Weather in Oslo as JSON"),),
        max_tokens=512,
        output_schema=SCHEMA,
    )
    return replace(base, **kw)


async def call(api: Api, wire: WireServer, req: ModelRequest) -> list[ModelEvent]:
    provider = api.connect(wire)
    try:
        return await collect(provider.stream(req))
    finally:
        await provider.aclose()


def text_of(events: list[ModelEvent]) -> str:
    blocks = assemble(events)
    return "".join(b.get("text", "") for b in blocks if b.get("type") == "text")


def only(wire: WireServer) -> Recorded:
    assert len(wire.requests) == 1, [r.path for r in wire.requests]
    return wire.requests[0]


# --- Anthropic: tool-forcing ---------------------------------------------------


def output_tool_reply(fragments: list[str], *, before: list[list[SSE]] | None = None) -> Reply:
    """The Messages API answering by calling the forced output tool (after ``before``)."""
    blocks = [*(before or [])]
    blocks.append(fake_anthropic.tool_use_block(len(blocks), "toolu_01Out", OUTPUT_TOOL, fragments))
    usage = fake_anthropic.Usage(output_tokens=30)
    return Reply(events=fake_anthropic._stream(blocks, "tool_use", usage))


async def test_anthropic_forces_the_output_tool_and_its_call_is_the_answer(
    wire: WireServer,
) -> None:
    wire.queue(output_tool_reply(PARTS))

    events = await call(ANTHROPIC, wire, request(ANTHROPIC))

    body = only(wire).json
    [tool] = body["tools"]
    assert tool["name"] == OUTPUT_TOOL and tool["input_schema"] == SCHEMA
    assert tool["description"]
    assert body["tool_choice"] == {"type": "tool", "name": OUTPUT_TOOL}
    # The call is shown as the answer's text, streamed as it came; it is no tool to run.
    assert events[:5] == [
        BlockStart(0, "text"),
        *(TextChunk(0, part) for part in PARTS),
        BlockStop(0),
    ]
    assert isinstance(events[5], UsageReport)
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.stop_reason == "end_turn"
    assert finish.extra["raw_stop_reason"] == "tool_use"
    value, errors = check(SCHEMA, text_of(events))
    assert errors == [] and value == ANSWER


async def test_anthropic_with_tools_forces_any_tool(wire: WireServer) -> None:
    # The model may call the agent's tools first, then must answer through the output tool.
    wire.queue(fake_anthropic.tool_call_reply("toolu_01W", "get_weather", ['{"city": "Oslo"}']))
    events = await call(ANTHROPIC, wire, request(ANTHROPIC, tools=(WEATHER,)))

    body = only(wire).json
    assert [t["name"] for t in body["tools"]] == ["get_weather", OUTPUT_TOOL]
    assert body["tool_choice"] == {"type": "any"}
    # The output tool is last: the tools' cache breakpoint covers it too.
    assert "cache_control" in body["tools"][-1]
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.stop_reason == "tool_use"


async def test_anthropic_with_a_tool_call_and_an_answer_runs_the_tool(wire: WireServer) -> None:
    weather = fake_anthropic.tool_use_block(0, "toolu_01W", "get_weather", ['{"city": "Oslo"}'])
    wire.queue(output_tool_reply(PARTS, before=[weather]))

    events = await call(ANTHROPIC, wire, request(ANTHROPIC, tools=(WEATHER,)))

    blocks = assemble(events)
    assert [b["type"] for b in blocks] == ["tool_use", "text"]
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.stop_reason == "tool_use"


async def test_anthropic_wraps_a_schema_whose_root_is_not_an_object(wire: WireServer) -> None:
    schema = {"type": "array", "items": {"type": "integer"}}
    wire.queue(output_tool_reply(['{"result": [1, ', "2, 3]}"]))

    events = await call(ANTHROPIC, wire, request(ANTHROPIC, output_schema=schema))

    [tool] = only(wire).json["tools"]
    assert tool["input_schema"] == {
        "type": "object",
        "properties": {"result": schema},
        "required": ["result"],
    }
    # Unwrapped, whole at the block's end.
    assert events[:3] == [BlockStart(0, "text"), TextChunk(0, "[1, 2, 3]"), BlockStop(0)]
    assert check(schema, text_of(events)) == ([1, 2, 3], [])


async def test_anthropic_with_extended_thinking_does_not_force(wire: WireServer) -> None:
    provider = AnthropicProvider(api_key="sk-ant-test", base_url=wire.url, thinking_budget=2048)
    wire.queue(output_tool_reply(PARTS))
    try:
        events = await collect(provider.stream(request(ANTHROPIC)))
    finally:
        await provider.aclose()
    body = only(wire).json
    assert body["tool_choice"] == {"type": "auto"}
    assert body["thinking"]["type"] == "enabled"
    assert check(SCHEMA, text_of(events)) == (ANSWER, [])


# --- OpenAI: response_format json_schema ---------------------------------------


async def test_openai_asks_for_the_json_schema_response_format(wire: WireServer) -> None:
    wire.queue(fake_openai.text_reply(PARTS))

    events = await call(OPENAI, wire, request(OPENAI, tools=(WEATHER,)))

    body = only(wire).json
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "result", "schema": SCHEMA, "strict": False},
    }
    assert [t["function"]["name"] for t in body["tools"]] == ["get_weather"]
    assert check(SCHEMA, text_of(events)) == (ANSWER, [])


# --- Gemini: the JSON response schema -------------------------------------------


async def test_gemini_asks_for_json_with_the_schema(wire: WireServer) -> None:
    wire.queue(fake_gemini.text_reply(PARTS))

    events = await call(GEMINI, wire, request(GEMINI))

    config = only(wire).json["generationConfig"]
    assert config["responseMimeType"] == "application/json"
    assert config["responseJsonSchema"] == SCHEMA
    assert check(SCHEMA, text_of(events)) == (ANSWER, [])


async def test_gemini_3_takes_the_schema_beside_tools(wire: WireServer) -> None:
    wire.queue(fake_gemini.text_reply(PARTS))

    events = await call(
        GEMINI, wire, request(GEMINI, model="gemini-3-pro-preview", tools=(WEATHER,))
    )

    body = only(wire).json
    assert body["generationConfig"]["responseJsonSchema"] == SCHEMA
    assert body["tools"][0]["functionDeclarations"][0]["name"] == "get_weather"
    assert check(SCHEMA, text_of(events)) == (ANSWER, [])


async def test_gemini_before_3_with_tools_is_asked_in_the_system_instruction(
    wire: WireServer,
) -> None:
    # Gemini 2.5 answers 400 to a JSON response beside function declarations.
    wire.queue(fake_gemini.text_reply(PARTS))

    events = await call(GEMINI, wire, request(GEMINI, tools=(WEATHER,)))

    body = only(wire).json
    config = body["generationConfig"]
    assert "responseMimeType" not in config and "responseJsonSchema" not in config
    system = json.dumps(body["systemInstruction"])
    assert json.dumps(json.dumps(SCHEMA, separators=(",", ":")))[1:-1] in system
    assert check(SCHEMA, text_of(events)) == (ANSWER, [])


# --- every provider -----------------------------------------------------------------


@pytest.mark.parametrize("api", [ANTHROPIC, OPENAI, GEMINI], ids=lambda api: api.name)
async def test_only_the_turns_own_calls_ask(api: Api, wire: WireServer) -> None:
    # A compaction summary (or a skill's sub-call) answers in prose.
    wire.queue(api.text("a summary"))

    await call(api, wire, request(api, purpose="summary"))

    raw = json.dumps(only(wire).json)
    for native in ("response_format", "responseJsonSchema", "tool_choice", OUTPUT_TOOL):
        assert native not in raw


@pytest.mark.parametrize("api", [ANTHROPIC, OPENAI, GEMINI], ids=lambda api: api.name)
async def test_without_a_schema_nothing_is_asked(api: Api, wire: WireServer) -> None:
    wire.queue(api.text("hello"))

    await call(api, wire, request(api, output_schema=None))

    raw = json.dumps(only(wire).json)
    for native in ("response_format", "responseJsonSchema", "tool_choice", OUTPUT_TOOL):
        assert native not in raw


# --- the scripted model ---------------------------------------------------------------


async def test_the_scripted_model_answers_each_attempt_from_its_script() -> None:
    script = "/script " + json.dumps({"results": [{"city": 1}, ANSWER]})
    first = ModelRequest(
        model="scripted", system="", messages=(user(script),), output_schema=SCHEMA
    )
    events = await collect(ScriptedProvider().stream(first))
    value, errors = check(SCHEMA, text_of(events))
    assert value == {"city": 1}
    assert [e["path"] for e in errors] == ["", "/city"]  # temperature missing, city a number

    corrected = replace(first, messages=(*first.messages, user("fix it")))
    events = await collect(ScriptedProvider().stream(corrected))
    assert check(SCHEMA, text_of(events)) == (ANSWER, [])
