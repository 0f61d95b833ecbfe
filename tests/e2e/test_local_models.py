"""Local OpenAI-compatible models that just work (#31, 1 and 2).

An engine serves ``openai:gemma-3-270m-it`` from a wire server that behaves
like llama-cpp-python's server with the ``gemma`` chat format: it drops the
system message and list content when it renders the prompt, reports no
usage, and a prompt at or over its 2,048-token window gets HTTP 200, one
chunk naming the role and the end of the body (the error only in its log).
No window is set: the engine takes the model for one of 32,768 tokens, finds
out from the first cut stream, compacts, and a 30-turn task completes.

And a window too small for any agent: the worker stays up, the gateway
refuses the model (422 ``MODEL_UNAVAILABLE``) and ``/health`` says why.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.providers import fake_openai
from tests.providers.apis import without_usage
from tests.providers.wire import Recorded, Reply, WireServer
from tests.sse_client import execute, long_task

WINDOW = 2048
TURNS = 30
MODEL = "gemma-3-270m-it"


class LlamaServer:
    """Renders each prompt as llama-cpp-python's gemma format does, and counts it."""

    def __init__(self) -> None:
        self.wire = WireServer()
        self.sizes: list[int] = []
        self.max_tokens: list[int] = []
        self.cut = 0
        self.system_messages = 0
        self.list_contents = 0
        self.first_user: list[str] = []
        # Answers that run until the window is full, as a small model asked for
        # a long story does: llama-cpp-python trims max_tokens to what the
        # window leaves and stops there with finish_reason "length".
        self.long_answers = False
        self.length_stops = 0

    def answer(self, request: Recorded) -> Reply:
        self.wire.queue(self.answer)  # one more for the next call
        body = request.json
        rendered: list[str] = []
        for message in body["messages"]:
            content = message.get("content")
            if message["role"] == "system":
                self.system_messages += 1  # the gemma format leaves it out
                continue
            if isinstance(content, list):
                self.list_contents += 1  # the chat formats render a list as nothing
                content = ""
            rendered.append(f"<start_of_turn>{message['role']}\n{content or ''}<end_of_turn>\n")
        first_user = next((m for m in body["messages"] if m["role"] == "user"), None)
        if first_user is not None and isinstance(first_user["content"], str):
            self.first_user.append(first_user["content"])
        size = len("".join(rendered)) // 4
        self.sizes.append(size)
        self.max_tokens.append(int(body.get("max_tokens") or 0))
        if size >= WINDOW:
            # "Requested tokens (N) exceed context window of 2048", in the log only.
            self.cut += 1
            return Reply(events=[fake_openai.chunk({"role": "assistant", "content": ""})])
        if self.long_answers:
            room = min(self.max_tokens[-1] or WINDOW, WINDOW - size)
            if room < self.max_tokens[-1]:
                self.length_stops += 1
            words = ["once upon a time "] * max(1, room * 4 // len("once upon a time "))
            return without_usage(fake_openai.text_reply(words, finish_reason="length"))
        answer = ["Noted: ", "the ", "message ", "is ", "kept."]
        return without_usage(fake_openai.text_reply(answer))


@pytest.fixture(scope="module")
def llama(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
) -> Iterator[tuple[LlamaServer, EngineProcesses]]:
    server = LlamaServer()
    server.wire.start()
    server.wire.queue(server.answer)
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}llama:",
        HOLDFAST_MODEL=f"openai:{MODEL}",
        OPENAI_BASE_URL=f"{server.wire.url}/v1",
    )
    env.pop("HOLDFAST_CONTEXT_WINDOW", None)
    try:
        with running_engine(env, workers=1) as procs:
            yield server, procs
    finally:
        server.wire.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_30_turn_task_completes_on_a_small_local_model_with_no_window_set(
    llama: tuple[LlamaServer, EngineProcesses], api_keys: dict[str, str]
) -> None:
    server, engine = llama
    task_id = f"llama-{secrets.token_hex(3)}"
    events = await long_task(
        engine.url, api_keys["main"], task_id, TURNS, filler=14, read_seconds=120
    )
    compactions = [e for e in events if e["type"] == "compaction_event"]
    assert compactions, f"no compaction; prompt sizes {server.sizes}"
    # The window is found out once (the first cut stream), then respected.
    assert 1 <= server.cut <= 2, f"{server.cut} cut streams; prompt sizes {server.sizes}"
    # Text goes as strings and the system prompt inside the first user message.
    assert server.list_contents == 0
    assert server.system_messages == 0
    turn_calls = [text for text in server.first_user if text.startswith("You are")]
    assert len(turn_calls) >= TURNS, server.first_user[:2]
    # max_tokens fits what the window leaves once the window is known.
    after_cut = server.max_tokens[server.sizes.index(max(server.sizes)) + 1 :]
    assert after_cut and max(after_cut) < WINDOW, server.max_tokens


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_answers_that_fill_the_window_teach_it_and_every_turn_completes(
    llama: tuple[LlamaServer, EngineProcesses], api_keys: dict[str, str]
) -> None:
    """The trial's failure (Gemma 3 270M on llama-cpp-python, 2,048 tokens): a
    first answer ran to the window's end, the next prompt (it included that
    answer) overflowed, and the task failed turn after turn. A stop at
    "length" well short of the max_tokens asked now teaches the window, so the
    next prompt is compacted before it is sent."""
    server, engine = llama
    server.long_answers = True
    task_id = f"fill-{secrets.token_hex(3)}"
    cut_before, stops_before = server.cut, server.length_stops
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            for i in range(6):
                got = await execute(
                    client,
                    engine.url,
                    api_keys["main"],
                    {"message": f"story {i}: a long one, please", "task_id": task_id},
                )
                assert got.events[-1]["phase"] == "completed", got.events[-4:]
                ended = [e for e in got.events if e["type"] == "content_block_stop"]
                assert ended, "an answer was kept"
    finally:
        server.long_answers = False
    assert server.length_stops > stops_before, "an answer ran to the window's end"
    # No prompt is sent over the window: the first answer's stop taught it (or
    # the module's first test did), and each next prompt is compacted to fit.
    assert server.cut == cut_before, f"prompt sizes {server.sizes}"


@pytest.fixture(scope="module")
def too_small(
    redis_url: str, database_url: str, redis_prefix: str, api_keys: dict[str, str]
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_url, database_url, f"{redis_prefix}tiny:", HOLDFAST_CONTEXT_WINDOW="1024"
    )
    with running_engine(env, workers=1) as procs:
        yield procs


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_window_too_small_for_any_agent_makes_the_model_unavailable(
    too_small: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        refused = await client.post(
            f"{too_small.url}/execute",
            headers={"X-Engine-Key": key},
            json={"message": "hello"},
        )
        health = await client.get(f"{too_small.url}/health", headers={"X-Engine-Key": key})
        bare = await client.get(f"{too_small.url}/health")
    assert refused.status_code == 422, refused.text
    error = refused.json()
    assert error["error"] == "MODEL_UNAVAILABLE"
    assert "1024 tokens" in error["message"]
    assert error["details"] == {"model": "scripted:scripted"}
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    unavailable = health.json()["subsystems"]["models"]["unavailable"]
    assert "too small" in json.dumps(unavailable)
    # The gateway itself is fine: probes without a key still see it up.
    assert bare.json() == {"status": "ok"}
    assert too_small.workers[0].poll() is None, "the worker stays up"


@pytest.fixture(scope="module")
def window_2048(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """The issue's set-up: a 2,048-token window, every built-in tool offered."""
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}w2048:",
        HOLDFAST_CONTEXT_WINDOW=str(WINDOW),
        SCRIPTED_CONTEXT_WINDOW=str(WINDOW),
        HOLDFAST_WORKSPACE_ROOT=str(tmp_path_factory.mktemp("w2048-workspaces")),
    )
    with running_engine(env, workers=1, runners=1) as procs:
        yield procs


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_a_2048_token_window_trims_the_fixed_prompt_and_serves_a_long_task(
    window_2048: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    task_id = f"w2048-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=120) as client:
        echoed = await execute(
            client,
            window_2048.url,
            key,
            {"message": '/script {"echo_request": true}', "task_id": task_id},
        )
        assert echoed.events[-1]["phase"] == "completed", echoed.events[-4:]
        for i in range(12):
            message = f"message {i}: " + "the quick brown fox jumps over the lazy dog " * 10
            got = await execute(
                client, window_2048.url, key, {"message": message, "task_id": task_id}
            )
            # SCRIPTED_CONTEXT_WINDOW refuses any request over the window.
            assert got.events[-1]["phase"] == "completed", got.events[-4:]
    sent = json.loads(echoed.text)
    assert {"bash", "read_file", "working_memory"} <= set(sent["tools"]), "every tool offered"
    assert window_2048.workers[0].poll() is None
