"""The OpenAI provider against what local servers do (#31, 1 and 2): text as
strings (llama.cpp's chat formats drop list content), the system prompt in the
first user message for templates that drop system messages (gemma), and each
shape of context overflow recognised."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.context.budget import Overflow, learned_window
from holdfast_loop_worker.turn.model_step import model_step
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers import ModelChoice, ProviderError
from holdfast_shared.providers.base import ModelRequest
from holdfast_shared.providers.calls import stream_with_retries
from holdfast_shared.providers.openai import (
    OpenAIProvider,
    folds_system,
    from_env,
    system_as_user_patterns,
)

from tests.providers import fake_openai as fake
from tests.providers.apis import OPENAI
from tests.providers.streams import SYSTEM, collect, collect_until_error, user
from tests.providers.test_faults import StepTurn
from tests.providers.wire import SSE, Reply, WireServer

pytestmark = pytest.mark.timeout(30)

PNG = {"type": "image", "media_type": "image/png", "data": "iVBORw0KGgo="}


@pytest.fixture
async def local(wire: WireServer) -> AsyncIterator[OpenAIProvider]:
    p = from_env({"OPENAI_BASE_URL": f"{wire.url}/v1"})
    assert p is not None
    yield p
    await p.aclose()


def request(model: str, *messages: ChatMessage, notes: str = "", soul: str = "") -> ModelRequest:
    return ModelRequest(
        model=model,
        system=SYSTEM,
        messages=messages or (user("Hello"),),
        max_tokens=512,
        notes=notes,
        soul=soul,
    )


async def sent(provider: OpenAIProvider, wire: WireServer, req: ModelRequest) -> list[dict]:  # type: ignore[type-arg]
    wire.queue(fake.text_reply(["ok"]))
    await collect(provider.stream(req))
    messages: list[dict] = wire.requests[-1].json["messages"]  # type: ignore[type-arg]
    return messages


async def test_text_and_notes_go_as_one_string(local: OpenAIProvider, wire: WireServer) -> None:
    messages = await sent(local, wire, request("qwen2.5-0.5b", notes="# Working memory\n- a"))

    assert messages == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hello\n\n# Working memory\n- a"},
    ]


async def test_notes_join_the_last_text_part_of_a_message_with_media(
    local: OpenAIProvider, wire: WireServer
) -> None:
    with_image = ChatMessage("user", ({"type": "text", "text": "What is it?"},), media=(PNG,))
    messages = await sent(local, wire, request("llava", with_image, notes="N"))

    parts = messages[-1]["content"]
    assert [p["type"] for p in parts] == ["image_url", "text"]
    assert parts[-1]["text"] == "What is it?\n\nN"


async def test_gemma_gets_the_system_prompt_in_its_first_user_message(
    local: OpenAIProvider, wire: WireServer
) -> None:
    history = (user("First"), ChatMessage("assistant", ({"type": "text", "text": "A"},)))
    req = request("gemma-3-270m-it", *history, user("Second"), soul="SOUL", notes="N")

    messages = await sent(local, wire, req)

    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[0]["content"] == f"{SYSTEM}\n\nSOUL\n\nFirst"
    assert messages[-1]["content"] == "Second\n\nN"


async def test_the_fold_is_a_setting(wire: WireServer) -> None:
    env = {"OPENAI_BASE_URL": f"{wire.url}/v1", "HOLDFAST_OPENAI_SYSTEM_AS_USER": ""}
    provider = from_env(env)
    assert provider is not None
    messages = await sent(provider, wire, request("gemma-3-270m-it"))
    await provider.aclose()

    assert messages[0] == {"role": "system", "content": SYSTEM}
    patterns = system_as_user_patterns(" Gemma*, mistral-7b* ,")
    assert patterns == ("gemma*", "mistral-7b*")
    assert folds_system("GEMMA-2-2b", patterns)
    assert not folds_system("my-gemma", patterns)
    assert folds_system("google/gemma-3-1b", system_as_user_patterns("*gemma*"))


def _error(status: int, message: str, type_: str = "invalid_request_error") -> Reply:
    return Reply(status=status, body=fake.error_body(message, type_))


@pytest.mark.parametrize(
    ("reply", "window"),
    [
        # llama-cpp-python's server (its ValueError's text, as a 400)
        (_error(400, "Requested tokens (2087) exceed context window of 2048"), "2048"),
        # llama.cpp's own server
        (
            _error(
                400,
                "the request exceeds the available context size (2048 tokens), try increasing it",
                "exceed_context_size_error",
            ),
            "2048",
        ),
        (_error(400, "context shift is disabled"), None),
        # vLLM
        (
            _error(
                400,
                "This model's maximum context length is 4096 tokens. However, you requested "
                "4200 tokens (4100 in the messages, 100 in the completion).",
            ),
            "4096",
        ),
        # inside a 200 stream, after the role chunk
        (
            Reply(
                events=[
                    fake.chunk({"role": "assistant", "content": ""}),
                    SSE(
                        fake.error_body(
                            "Requested tokens (3000) exceed context window of 2048", "x"
                        )
                    ),
                ]
            ),
            "2048",
        ),
    ],
    ids=["llama-cpp-python", "llama.cpp", "context-shift", "vllm", "mid-stream"],
)
async def test_each_overflow_shape_is_a_context_overflow(
    local: OpenAIProvider, wire: WireServer, reply: Reply, window: str | None
) -> None:
    wire.queue(reply, fake.text_reply(["never sent"]))

    _, error = await collect_until_error(
        stream_with_retries(local, request("m"), initial_wait=0.01, max_wait=1)
    )

    assert error.code == "CONTEXT_OVERFLOW"
    assert error.retryable is False
    assert len(wire.requests) == 1
    if window is not None:
        assert window in error.message


async def test_a_stream_cut_before_any_output_is_a_suspected_overflow(
    local: OpenAIProvider, wire: WireServer
) -> None:
    # llama-cpp-python past its window: HTTP 200, the role, then the body ends.
    wire.queue(Reply(events=[fake.chunk({"role": "assistant", "content": ""})]))

    events, error = await collect_until_error(
        stream_with_retries(local, request("m"), initial_wait=0.01, max_wait=1)
    )

    assert events == []
    assert error.code == "CONTEXT_OVERFLOW"
    assert (error.details or {}).get("suspected_overflow") is True
    assert len(wire.requests) == 1


async def test_a_stream_cut_after_output_is_still_a_transient_error(
    local: OpenAIProvider, wire: WireServer
) -> None:
    wire.queue(fake.ended_without_finish(["half an "]))

    _, error = await collect_until_error(local.stream(request("m")))

    assert error.code == "LLM_PROVIDER_ERROR"
    assert error.retryable is True


# --- the model step: a cut stream on a long prompt compacts, on a short one retries ---

CUT = Reply(events=[fake.chunk({"role": "assistant", "content": ""})])


@dataclass
class ShrinkingTurn(StepTurn):
    """A turn whose context compacts to ``after`` tokens once told of an overflow."""

    after: int = 500
    overflows: list[Any] = field(default_factory=list)

    async def prepare(
        self, choice: ModelChoice, *, harder: bool = False, overflow: Any = None
    ) -> Assembled:
        if overflow is not None:
            self.overflows.append(overflow)
            self.estimate = self.after
        return await super().prepare(choice)


async def test_a_cut_stream_on_a_long_prompt_compacts_and_calls_again(wire: WireServer) -> None:
    provider = OPENAI.connect(wire)
    wire.queue(CUT, fake.text_reply(["fits now"]))
    turn = ShrinkingTurn(api=OPENAI, estimate=2100)

    await model_step(turn, ModelChoice(provider, OPENAI.model))
    await provider.aclose()

    assert [(o.prompt_tokens, o.window, o.suspected) for o in turn.overflows] == [
        (2100, None, True)
    ]
    assert len(wire.requests) == 2
    assert turn.client_text().text == "fits now"


async def test_a_cut_stream_on_a_short_prompt_is_made_again_as_it_is(wire: WireServer) -> None:
    provider = OPENAI.connect(wire)
    wire.queue(CUT, fake.text_reply(["second try"]))
    turn = ShrinkingTurn(api=OPENAI, estimate=300)

    await model_step(turn, ModelChoice(provider, OPENAI.model))
    await provider.aclose()

    assert turn.overflows == []  # no window is that small: not an overflow
    assert len(wire.requests) == 2
    assert turn.client_text().text == "second try"


async def test_a_cut_stream_on_a_prompt_the_model_answered_before_is_made_again(
    wire: WireServer,
) -> None:
    """A real trial (llama-cpp-python, Gemma 3 270M): a turn's request was cut
    before any output because the server dropped it for the learning centre's
    (``interrupt_requests``); the engine took it for an overflow, assumed a
    window below prompts the model had answered, and failed the turn. A prompt
    no bigger than one answered before is sent again as it is."""
    provider = OPENAI.connect(wire)
    wire.queue(fake.text_reply(["first"]), CUT, fake.text_reply(["again"]))
    turn = ShrinkingTurn(api=OPENAI, estimate=1800)
    choice = ModelChoice(provider, OPENAI.model)
    await model_step(turn, choice)
    turn.estimate = 1500  # a smaller prompt, cut
    await model_step(turn, choice)
    await provider.aclose()

    assert turn.answered >= 1800
    assert turn.overflows == []  # not taken for an overflow
    assert len(wire.requests) == 3
    assert turn.client_text().text.endswith("again")


def test_no_window_is_learned_below_a_prompt_the_model_answered() -> None:
    cut = Overflow(prompt_tokens=2000, window=None, suspected=True)
    assert learned_window(cut, current=32_768) == 1900
    assert learned_window(cut, current=32_768, fitted=1950) == 1950
    named = Overflow(prompt_tokens=2000, window=1800, suspected=False)
    assert learned_window(named, current=32_768, fitted=1950) == 1800  # the server said so


async def test_an_overflow_that_cannot_shrink_fails_with_the_providers_error(
    wire: WireServer,
) -> None:
    provider = OPENAI.connect(wire)
    wire.queue(fake.vllm_context_length_exceeded())
    turn = ShrinkingTurn(api=OPENAI, estimate=3000, after=3000)

    with pytest.raises(ProviderError) as raised:
        await model_step(turn, ModelChoice(provider, OPENAI.model))
    await provider.aclose()

    assert raised.value.code == "CONTEXT_OVERFLOW"
    assert len(turn.overflows) == 1 and len(wire.requests) == 1
