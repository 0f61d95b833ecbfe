"""Structured results (#27) through the whole engine against each provider's
wire server (real SDKs in a real worker): the native request on every call
(Anthropic's forced output tool, OpenAI's ``response_format``, Gemini's JSON
schema), an invalid first answer corrected once — the second call carries
the first answer and the errors, in a conversation the API accepts — and the
``result`` event.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from holdfast_shared.providers.structured import OUTPUT_TOOL

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.providers import fake_anthropic, fake_gemini, fake_openai
from tests.providers.wire import Reply, WireServer
from tests.sse_client import execute

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

# "reasoning" first on purpose: a model writes properties in the schema's order.
ANSWER = {
    "type": "object",
    "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
    "required": ["answer"],
}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, WireServer]]:
    # Each API's own checks: a conversation the real API would refuse (an
    # output tool call left without its result, say) is refused here too.
    checks = (fake_anthropic.refuse, fake_openai.refuse, fake_gemini.refuse)
    started = {name: WireServer(checks).start() for name in ("anthropic", "openai", "gemini")}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module")
def provider_engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    servers: dict[str, WireServer],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}structured-providers:",
        ANTHROPIC_API_KEY="sk-ant-test",
        ANTHROPIC_BASE_URL=servers["anthropic"].url,
        OPENAI_API_KEY="sk-openai-test",
        OPENAI_BASE_URL=f"{servers['openai'].url}/v1",
        GEMINI_API_KEY="gemini-test",
        HOLDFAST_GEMINI_BASE_URL=servers["gemini"].url,
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("structured")) as procs:
        yield procs


def _anthropic_answer(text: str) -> Reply:
    """The Messages API answering through the forced output tool."""
    block = fake_anthropic.tool_use_block(0, "toolu_01Out", OUTPUT_TOOL, [text])
    return Reply(events=fake_anthropic._stream([block], "tool_use", fake_anthropic.Usage()))


def _system_text(body: dict[str, Any]) -> str:
    parts = body.get("systemInstruction", {}).get("parts", [])
    return "".join(part.get("text", "") for part in parts)


NATIVE: dict[str, tuple[str, Callable[[str], Reply], Callable[[dict[str, Any]], Any]]] = {
    "anthropic": (
        f"anthropic:{fake_anthropic.MODEL}",
        _anthropic_answer,
        lambda body: (body["tool_choice"], body["tools"][-1]["input_schema"]),
    ),
    "openai": (
        f"openai:{fake_openai.MODEL}",
        lambda text: fake_openai.text_reply([text]),
        lambda body: (
            body["response_format"]["type"],
            body["response_format"]["json_schema"]["schema"],
        ),
    ),
    # Gemini 3 takes the JSON schema beside the agent's tools.
    "gemini-3": (
        "gemini:gemini-3-flash-preview",
        lambda text: fake_gemini.text_reply([text]),
        lambda body: (
            body["generationConfig"]["responseMimeType"],
            body["generationConfig"]["responseJsonSchema"],
        ),
    ),
    # Gemini 2.5 refuses that (a 400): the schema is in the system instruction.
    "gemini-2.5": (
        f"gemini:{fake_gemini.MODEL}",
        lambda text: fake_gemini.text_reply([text]),
        lambda body: (
            "responseMimeType" in body["generationConfig"],
            # (The schema as stored: JSONB orders an object's keys its own way.)
            "matching this JSON Schema" in _system_text(body)
            and '"answer":{"type":"integer"}' in _system_text(body),
        ),
    ),
}
ASKED: dict[str, Any] = {
    "anthropic": ({"type": "any"}, ANSWER),
    "openai": ("json_schema", ANSWER),
    "gemini-3": ("application/json", ANSWER),
    "gemini-2.5": (False, True),
}


@pytest.mark.parametrize("provider", sorted(NATIVE))
async def test_each_provider_answers_natively_and_is_corrected_once(
    provider_engine: EngineProcesses,
    api_keys: dict[str, str],
    servers: dict[str, WireServer],
    provider: str,
) -> None:
    model, reply, native = NATIVE[provider]
    server = servers[provider.split("-")[0]]
    server.replies.clear()
    server.requests.clear()
    server.queue(reply('{"answer": "four"}'), reply('{"answer": 4}'))
    body = {"message": "2 + 2?", "model": model, "output_schema": ANSWER}
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(client, provider_engine.url, api_keys["main"], body)
    assert got.status == 200, got.body
    [result] = [e for e in got.events if e["type"] == "result"]
    assert (result["result"], result["attempts"]) == ({"answer": 4}, 2)
    assert got.events[-1]["phase"] == "completed"
    # Both calls asked (natively, but Gemini 2.5 with tools); the second carries
    # the first answer and the correction.
    assert [native(r.json) for r in server.requests] == [ASKED[provider]] * 2
    if provider != "gemini-2.5":
        # The schema reached the model as it was sent, its properties in order.
        sent = native(server.requests[0].json)[1]
        assert list(sent["properties"]) == ["reasoning", "answer"]
    second = json.dumps(server.requests[1].json)
    assert "'four' is not of type 'integer'" in second
    assert "answer" in second and "four" in second
