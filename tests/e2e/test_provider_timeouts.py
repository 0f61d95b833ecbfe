"""A model server that answers late or never stops, in a real engine (#29): the
bounds come from the settings, and no turn hangs.

The engine serves ``openai:local-model`` from a Chat Completions wire server
(tests/providers/fake_openai.py) with short bounds: 0.5 s to the first event
and between two, 2 s per call.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.chaos.invariants import visible_text
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.providers import fake_openai
from tests.providers.apis import endless
from tests.providers.wire import WireServer
from tests.sse_client import execute

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def served(
    redis_url: str, database_url: str, redis_prefix: str, api_keys: dict[str, str]
) -> Iterator[tuple[WireServer, EngineProcesses]]:
    wire = WireServer().start()
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}timeouts:",
        HOLDFAST_MODEL="openai:local-model",
        OPENAI_BASE_URL=f"{wire.url}/v1",
        OPENAI_API_KEY="unused",
        HOLDFAST_MODEL_FIRST_EVENT_TIMEOUT_SECONDS="0.5",
        HOLDFAST_MODEL_IDLE_TIMEOUT_SECONDS="0.5",
        HOLDFAST_MODEL_CALL_TIMEOUT_SECONDS="2",
    )
    try:
        with running_engine(env, workers=1) as procs:
            yield wire, procs
    finally:
        wire.stop()


async def test_a_late_first_byte_is_cut_and_the_call_made_again(
    served: tuple[WireServer, EngineProcesses], api_keys: dict[str, str]
) -> None:
    wire, engine = served
    late = fake_openai.text_reply(["Too ", "late."])
    late.first_delay = 10.0
    wire.queue(late, fake_openai.text_reply(["On ", "time."]))
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(
            client,
            engine.url,
            api_keys["main"],
            {"message": "hi", "task_id": f"late-{secrets.token_hex(3)}"},
        )

    assert got.events[-1]["phase"] == "completed", got.events[-4:]
    assert visible_text(got.events) == "On time."
    assert time.monotonic() - started < 8.0, "cut at 0.5 s, not after the 10 s the server took"


async def test_an_endless_stream_ends_the_turn_at_the_call_bound(
    served: tuple[WireServer, EngineProcesses], api_keys: dict[str, str]
) -> None:
    wire, engine = served
    wire.queue(endless(fake_openai.text_reply(["la "]), "la ", every=0.05))
    calls = len(wire.requests)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(
            client,
            engine.url,
            api_keys["main"],
            {"message": "sing", "task_id": f"song-{secrets.token_hex(3)}"},
        )

    assert got.events[-1]["phase"] == "errored", got.events[-4:]
    error = next(e for e in got.events if e["type"] == "error")
    assert error["error"] == "LLM_PROVIDER_ERROR"
    assert error["details"]["timeout"] == "call"
    assert got.types[-4:] == ["content_block_stop", "usage", "error", "thread_lifecycle"]
    assert visible_text(got.events).startswith("la la la ")
    assert 2.0 <= time.monotonic() - started < 10.0
    assert len(wire.requests) == calls + 1, "not retried: it would stream again"
