"""An MCP server's sampling request served by the turn's model
(turn/sampling.py), with the scripted provider: the server's conversation and
system prompt reach the model, the answer comes back in MCP's words, and its
tokens are added to the turn's usage; a failing or overflowing call is an
answer with an error, not an exception in the turn."""

from __future__ import annotations

from holdfast_loop_worker.turn.sampling import MAX_TOKENS, _request, sample
from holdfast_shared.jobs import ToolSampling
from holdfast_shared.providers import ModelChoice
from holdfast_shared.providers.scripted import ScriptedProvider


def _asked(text: str, **extra: object) -> ToolSampling:
    return ToolSampling.model_validate(
        {
            "messages": [{"role": "user", "text": text}],
            "system_prompt": "You are a helpful test server.",
            "max_tokens": 100,
            "reply_key": "unused",
            "wait_seconds": 30.0,
            **extra,
        }
    )


async def test_the_answer_is_the_models_and_its_tokens_count_in_the_turn() -> None:
    choice = ModelChoice(ScriptedProvider(), "scripted-model")
    usage = {"input_tokens": 100, "output_tokens": 10}
    answer = await sample(choice, _asked("what is two and two"), attempts=1, usage=usage)
    assert answer.error is None
    assert answer.text == "You said: what is two and two"
    assert answer.model == "scripted:scripted-model" and answer.stop_reason == "endTurn"
    assert usage["input_tokens"] > 100 and usage["output_tokens"] > 10


def test_the_request_keeps_the_conversation_and_bounds_its_size() -> None:
    choice = ModelChoice(ScriptedProvider(), "m")
    asked = _asked(
        "hi",
        messages=[
            {"role": "user", "text": "hi"},
            {"role": "assistant", "text": "hello"},
            {"role": "user", "text": "again"},
        ],
        max_tokens=10**9,
    )
    request = _request(choice, asked)
    assert [(m.role, m.text) for m in request.messages] == [
        ("user", "hi"),
        ("assistant", "hello"),
        ("user", "again"),
    ]
    assert request.system == "You are a helpful test server."
    assert request.max_tokens == MAX_TOKENS and request.purpose == "turn"


async def test_a_call_the_provider_refuses_is_an_error_answer() -> None:
    # A window smaller than the request: the scripted provider refuses it (CONTEXT_OVERFLOW).
    choice = ModelChoice(ScriptedProvider(context_window=1), "m")
    usage: dict[str, int] = {}
    answer = await sample(
        choice, _asked("a request too long for the window"), attempts=1, usage=usage
    )
    assert answer.error is not None and "the model call failed" in answer.error
    assert answer.text == "" and usage == {}
