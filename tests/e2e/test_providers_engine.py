"""Every provider through the whole engine: real SDKs in a real worker, wire-protocol servers.

The same turn, answered by Anthropic, OpenAI and Gemini servers, reaches the
client as the same event sequence; usage is the provider's; a 429 before any
output is retried inside the turn and the client never notices.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.providers import fake_anthropic, fake_gemini, fake_openai
from tests.providers.wire import WireServer
from tests.sse_client import execute

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, WireServer]]:
    started = {name: WireServer().start() for name in ("anthropic", "openai", "gemini")}
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
        f"{redis_prefix}providers:",
        ANTHROPIC_API_KEY="sk-ant-test",
        ANTHROPIC_BASE_URL=servers["anthropic"].url,
        OPENAI_API_KEY="sk-openai-test",
        OPENAI_BASE_URL=f"{servers['openai'].url}/v1",
        GEMINI_API_KEY="gemini-test",
        HOLDFAST_GEMINI_BASE_URL=servers["gemini"].url,
        HOLDFAST_AGENT_MODELS=f'{{"researcher": "gemini:{fake_gemini.MODEL}"}}',
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("providers")) as procs:
        yield procs


# Usage the engine believes (it takes a report implying 1-8 characters a token:
# context/tokens.plausible): the prompt, system prompt and tool definitions
# included, is about 6,500 characters; "Hello there" is 11.
REPLIES = {
    "anthropic": (
        f"anthropic:{fake_anthropic.MODEL}",
        lambda: fake_anthropic.text_reply(
            ["Hel", "lo ", "there"], fake_anthropic.Usage(input_tokens=1500, output_tokens=3)
        ),
        {"input_tokens": 1500, "output_tokens": 3},
    ),
    "openai": (
        f"openai:{fake_openai.MODEL}",
        lambda: fake_openai.text_reply(["Hel", "lo ", "there"]),
        None,
    ),
    "gemini": (
        f"gemini:{fake_gemini.MODEL}",
        lambda: fake_gemini.text_reply(["Hel", "lo ", "there"], prompt=1400, output=4),
        {"input_tokens": 1400, "output_tokens": 4},
    ),
}


@pytest.mark.parametrize("provider", sorted(REPLIES))
async def test_each_provider_gives_the_same_event_sequence(
    provider_engine: EngineProcesses,
    api_keys: dict[str, str],
    servers: dict[str, WireServer],
    provider: str,
) -> None:
    model, reply, usage = REPLIES[provider]
    server = servers[provider]
    server.replies.clear()
    server.requests.clear()
    server.queue(reply())
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client, provider_engine.url, api_keys["main"], {"message": "hi", "model": model}
        )
    assert got.status == 200, got.body
    assert got.types == [
        "thread_lifecycle",
        "content_block_start",
        "text_delta",
        "text_delta",
        "text_delta",
        "content_block_stop",
        "usage",
        "thread_lifecycle",
    ]
    assert got.text == "Hello there"
    assert got.events[-1] == {**got.events[-1], "phase": "completed", "stop_reason": "end_turn"}
    if usage is not None:
        assert {k: got.events[-2][k] for k in usage} == usage
    assert len(server.requests) == 1
    # The conversation reached the provider: the user's message is in the request.
    assert "hi" in str(server.requests[0].json)


async def test_rate_limit_before_output_is_retried_inside_the_turn(
    provider_engine: EngineProcesses, api_keys: dict[str, str], servers: dict[str, WireServer]
) -> None:
    server = servers["anthropic"]
    server.replies.clear()
    server.requests.clear()
    server.queue(fake_anthropic.rate_limited("1"), fake_anthropic.text_reply(["after ", "wait"]))
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client,
            provider_engine.url,
            api_keys["main"],
            {"message": "hi", "model": f"anthropic:{fake_anthropic.MODEL}"},
        )
    assert len(server.requests) == 2
    assert "error" not in got.types
    assert got.text == "after wait"
    assert got.events[-1]["phase"] == "completed"


async def test_provider_failure_ends_the_turn_with_a_stable_code(
    provider_engine: EngineProcesses, api_keys: dict[str, str], servers: dict[str, WireServer]
) -> None:
    server = servers["openai"]
    server.replies.clear()
    server.queue(fake_openai.context_length_exceeded())
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client,
            provider_engine.url,
            api_keys["main"],
            {"message": "hi", "model": f"openai:{fake_openai.MODEL}"},
        )
        task_id = got.headers["x-task-id"]
        server.queue(fake_openai.text_reply(["fine"]))
        again = await execute(
            client,
            provider_engine.url,
            api_keys["main"],
            {"message": "shorter", "model": f"openai:{fake_openai.MODEL}", "task_id": task_id},
        )
    # Nothing to compact in a first message: the provider's error ends the turn.
    assert got.types == ["thread_lifecycle", "usage", "error", "thread_lifecycle"]
    assert got.events[2]["error"] == "CONTEXT_OVERFLOW"
    assert got.events[-1]["phase"] == "errored"
    assert again.text == "fine" and again.events[-1]["phase"] == "completed", again.events


async def test_an_agent_brings_its_own_model(
    provider_engine: EngineProcesses, api_keys: dict[str, str], servers: dict[str, WireServer]
) -> None:
    gemini, anthropic = servers["gemini"], servers["anthropic"]
    for server in (gemini, anthropic):
        server.replies.clear()
        server.requests.clear()
    gemini.queue(fake_gemini.text_reply(["from ", "gemini"]))
    anthropic.queue(fake_anthropic.text_reply(["from ", "claude"]))
    async with httpx.AsyncClient(timeout=30) as client:
        by_agent = await execute(
            client, provider_engine.url, api_keys["main"], {"message": "hi", "agent": "researcher"}
        )
        by_request = await execute(
            client,
            provider_engine.url,
            api_keys["main"],
            {
                "message": "hi",
                "agent": "researcher",
                "model": f"anthropic:{fake_anthropic.MODEL}",
            },
        )
    assert by_agent.text == "from gemini" and len(gemini.requests) == 1
    assert by_request.text == "from claude" and len(anthropic.requests) == 1
