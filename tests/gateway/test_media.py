"""Media on ``/execute``, through the whole engine: to the model, or a 422 before the turn.

A worker with keys for the three providers (their base URLs point at the
wire-protocol servers of ``tests/providers``) serves a gateway. Media the
turn's model takes reach its server in the API's own format; a type it
cannot take is refused with ``422 UNSUPPORTED_MEDIA`` naming the type, and
nothing is stored or sent. The turn's model is the request's, else the
agent's, else the default the workers advertise — here the worker's own
``HOLDFAST_MODEL``, which the gateway is not told.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from holdfast_gateway.tasks import find_task
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, engine_from_env
from tests.providers import fake_anthropic, fake_gemini, fake_openai
from tests.providers.wire import WireServer
from tests.sse_client import execute
from tests.taskids import TENANTS

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9"
    "awAAAABJRU5ErkJggg=="
)
PDF_URL = "https://example.org/report.pdf"
GEMINI = f"gemini:{fake_gemini.MODEL}"


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, WireServer]]:
    checks = (fake_anthropic.refuse, fake_openai.refuse, fake_gemini.refuse)
    started = {name: WireServer(checks).start() for name in ("anthropic", "openai", "gemini")}
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture
def wires(servers: dict[str, WireServer]) -> dict[str, WireServer]:
    for server in servers.values():
        server.replies.clear()
        server.requests.clear()
    return servers


@pytest.fixture(scope="module")
def media_engine(
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
        f"{redis_prefix}media:",
        # Over the agent's own preferred model (OpenAI's).
        HOLDFAST_AGENT_MODELS=f'{{"analyst": "anthropic:{fake_anthropic.MODEL}"}}',
    )
    worker_env = {
        "ANTHROPIC_API_KEY": "sk-ant-test",
        "ANTHROPIC_BASE_URL": servers["anthropic"].url,
        "OPENAI_API_KEY": "sk-openai-test",
        "OPENAI_BASE_URL": f"{servers['openai'].url}/v1",
        "GEMINI_API_KEY": "gemini-test",
        "HOLDFAST_GEMINI_BASE_URL": servers["gemini"].url,
        # Only the worker runs Gemini by default; the gateway keeps "scripted"
        # (which takes anything), so only the advertised default can refuse.
        "HOLDFAST_MODEL": GEMINI,
    }
    with engine_from_env(env, tmp_path_factory.mktemp("media")) as procs:
        procs.start("loop-worker", env=worker_env)
        procs.start_gateway()
        yield procs


async def post(engine: EngineProcesses, key: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        return await client.post("/execute", json=body, headers={"X-Engine-Key": key})


async def stored(sessions: async_sessionmaker[AsyncSession], name: str) -> bool:
    async with sessions() as session:
        return await find_task(session, TENANTS["main"], name) is not None


async def test_media_reach_the_model_in_its_own_format(
    media_engine: EngineProcesses, api_keys: dict[str, str], wires: dict[str, WireServer]
) -> None:
    wires["gemini"].queue(fake_gemini.text_reply(["A dot and a report."]))
    media = [
        {"type": "image", "media_type": "image/png", "data": PNG, "name": "dot.png"},
        {"type": "file", "media_type": "application/pdf", "url": PDF_URL},
    ]
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client,
            media_engine.url,
            api_keys["main"],
            {"message": "What are these?", "model": GEMINI, "media": media},
        )

    assert got.status == 200, got.body
    assert got.events[-1]["phase"] == "completed", got.events[-1]
    [sent] = wires["gemini"].requests
    parts = sent.json["contents"][-1]["parts"]
    png = base64.urlsafe_b64encode(base64.b64decode(PNG)).decode()
    assert parts[:3] == [
        {"inlineData": {"mimeType": "image/png", "data": png}},
        {"fileData": {"mimeType": "application/pdf", "fileUri": PDF_URL}},
        {"text": "What are these?"},
    ]


@pytest.mark.parametrize(
    ("body", "media_type", "provider"),
    [
        # The request's model: Chat Completions gives audio to audio models only.
        ({"model": "openai:gpt-4.1"}, "audio/wav", "openai"),
        # The agent's model (HOLDFAST_AGENT_MODELS): Anthropic takes no video.
        ({"agent": "analyst"}, "video/mp4", "anthropic"),
        # The worker's default, as it advertises it: Gemini takes no GIF.
        ({}, "image/gif", "gemini"),
    ],
    ids=["request-model", "agent-model", "default-model"],
)
async def test_a_type_the_turns_model_cannot_take_is_422_before_the_turn(
    media_engine: EngineProcesses,
    api_keys: dict[str, str],
    wires: dict[str, WireServer],
    sessions: async_sessionmaker[AsyncSession],
    body: dict[str, Any],
    media_type: str,
    provider: str,
) -> None:
    name = f"media-refused-{provider}"
    kind = media_type.split("/")[0]
    item = {"type": kind, "media_type": media_type, "data": PNG}

    response = await post(
        media_engine,
        api_keys["main"],
        {"message": "Look.", "task_id": name, "media": [item], **body},
    )

    assert response.status_code == 422, response.text
    error = response.json()
    assert error["error"] == "UNSUPPORTED_MEDIA"
    assert media_type in error["message"]
    assert error["details"]["media_type"] == media_type
    assert error["details"]["model"].startswith(f"{provider}:")
    assert error["details"]["index"] == 0
    assert not await stored(sessions, name), "a refused message was stored"
    assert all(not server.requests for server in wires.values())


async def test_the_default_model_takes_what_it_can(
    media_engine: EngineProcesses, api_keys: dict[str, str], wires: dict[str, WireServer]
) -> None:
    wires["gemini"].queue(fake_gemini.text_reply(["A dot."]))
    media = [{"type": "image", "media_type": "image/png", "data": PNG}]
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client, media_engine.url, api_keys["main"], {"message": "And this?", "media": media}
        )

    assert got.status == 200, got.body
    assert got.events[-1]["phase"] == "completed", got.events[-1]
    [sent] = wires["gemini"].requests
    assert "inlineData" in sent.json["contents"][-1]["parts"][0]
