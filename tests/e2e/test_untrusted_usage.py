"""A local model server whose usage figures are wrong or missing (#29, #31): a
long task still compacts on time, and its usage events say they are estimated.

An engine serves ``openai:local-model`` from a wire server speaking the Chat
Completions protocol (tests/providers/fake_openai.py) the way llama.cpp's
does: its usage is a constant (1 prompt token whatever the prompt) or absent,
and it refuses a prompt over its window with llama.cpp's error, after
counting it itself (four characters a token of the messages' JSON). A
calibration that believed those figures would shrink every estimate and let
the context outgrow the window; every request must fit instead.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import pytest

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.providers import fake_openai
from tests.providers.apis import without_usage
from tests.providers.wire import Recorded, Reply, WireServer
from tests.sse_client import long_task

# Room for the fixed sections (no tool-runners, so no tools) and a few thousand
# tokens of conversation; the server's own limit is the window.
WINDOW = 4700
TURNS = 36


class LocalServer:
    """Answers every call, with the usage figures of its kind; refuses what is over its window."""

    def __init__(self, usage: str) -> None:
        self.usage = usage
        self.sizes: list[int] = []
        self.refused = 0
        self.wire = WireServer()

    def answer(self, request: Recorded) -> Reply:
        size = len(json.dumps(request.json["messages"])) // 4
        self.sizes.append(size)
        self.wire.queue(self.answer)  # one more for the next call
        if size > WINDOW:
            self.refused += 1
            message = f"request ({size} tokens) exceeds the available context size ({WINDOW})"
            body = fake_openai.error_body(message, "exceed_context_size_error", "400")
            return Reply(status=400, body=body)
        text = ["Noted: ", "the ", "message ", "is ", "stored."]
        if self.usage == "constant":
            return fake_openai.text_reply(text, usage_body=fake_openai.usage(1, 1))
        return without_usage(fake_openai.text_reply(text))


@pytest.fixture(scope="module", params=["constant", "missing"])
def local(
    request: pytest.FixtureRequest,
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
) -> Iterator[tuple[LocalServer, EngineProcesses]]:
    server = LocalServer(request.param)
    server.wire.start()
    server.wire.queue(server.answer)
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}usage-{request.param}:",
        HOLDFAST_MODEL="openai:local-model",
        OPENAI_BASE_URL=f"{server.wire.url}/v1",
        OPENAI_API_KEY="unused",
        HOLDFAST_CONTEXT_WINDOW=str(WINDOW),
    )
    try:
        with running_engine(env, workers=1) as procs:
            yield server, procs
    finally:
        server.wire.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_long_task_compacts_though_the_server_misreports_usage(
    local: tuple[LocalServer, EngineProcesses], api_keys: dict[str, str]
) -> None:
    server, engine = local
    task_id = f"local-{secrets.token_hex(3)}"
    events = await long_task(
        engine.url, api_keys["main"], task_id, TURNS, filler=16, read_seconds=60
    )
    compactions = [e for e in events if e["type"] == "compaction_event"]
    assert compactions, f"no compaction; prompt sizes {server.sizes}"
    assert server.refused == 0, f"a prompt outgrew the window: {max(server.sizes)}"
    usages = [e for e in events if e["type"] == "usage"]
    assert len(usages) == TURNS
    assert all(u.get("estimated") is True for u in usages)
    assert all(u["input_tokens"] > 100 for u in usages), "estimated, not 0 nor the constant"
