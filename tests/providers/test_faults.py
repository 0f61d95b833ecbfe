"""Model providers misbehaving (#29), each fault against each API's wire server
through the real SDK, and the loop's model step where the client's view is at stake.

The model step runs on an in-memory turn (``tests/loop_worker/fake_turn.py``)
that numbers its events as the log would, so what a client makes of them is
checked with the Python client's own :class:`~holdfast_client.TurnText`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from holdfast_client.events import parse_event as parse_client_event
from holdfast_client.text import TurnText
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.context.tokens import (
    PLAUSIBLE,
    recalibrate,
    sane_calibration,
    text_tokens,
)
from holdfast_loop_worker.turn.model_step import model_step
from holdfast_shared.events import ToolCall, TurnResumed, Usage, _Event, body_json
from holdfast_shared.providers import ModelChoice
from holdfast_shared.providers.base import ModelRequest, TextChunk
from holdfast_shared.providers.calls import (
    CallLimits,
    bounded,
    configured_limits,
    stream_with_retries,
)
from holdfast_shared.providers.waits import retry_after
from holdfast_shared.settings import Settings

from tests.loop_worker.fake_turn import FakeTurn
from tests.providers.apis import (
    Api,
    WireProvider,
    cut_at,
    each_api,
    endless,
    garbled,
    without_usage,
)
from tests.providers.streams import SYSTEM, WEATHER, collect, collect_until_error, user
from tests.providers.wire import SSE, Reply, WireServer

pytestmark = pytest.mark.timeout(60)

PARTS = ["Alpha ", "bravo ", "charlie ", "delta ", "echo."]
RETRIED = ["The ", "whole ", "answer."]


def request(api: Api) -> ModelRequest:
    return ModelRequest(
        model=api.model, system=SYSTEM, messages=(user("Weather?"),), tools=(WEATHER,)
    )


@dataclass
class StepTurn(FakeTurn):
    """A fake turn whose model step calls a real provider; events numbered as logged."""

    api: Api | None = None
    attempts: int = 3
    # The prompt's local estimate, about what the fakes report by default.
    estimate: int = 20
    shown: list[_Event] = field(default_factory=list)

    async def emit(self, event: _Event) -> None:
        numbered = event.model_copy(update={"seq": len(self.events) + 1})
        self.events.append(numbered)

    @property
    def retry_attempts(self) -> int:
        return self.attempts

    async def prepare(
        self, choice: ModelChoice, *, harder: bool = False, overflow: Any = None
    ) -> Assembled:
        assert self.api is not None
        return Assembled(request(self.api), tokens=self.estimate, view=(), fixed_tokens=10)

    def client_text(self) -> TurnText:
        """The turn's text as the Python client shows it (discarded ranges dropped)."""
        text = TurnText()
        for event in self.events:
            wire = body_json(event)[:-1] + f',"seq":{event.seq}}}'
            text.feed(parse_client_event(wire))
        return text


@pytest.fixture
async def connected(api: Api, wire: WireServer) -> AsyncIterator[WireProvider]:
    provider = api.connect(wire)
    yield provider
    await provider.aclose()


async def step(api: Api, provider: WireProvider, **kw: Any) -> StepTurn:
    turn = StepTurn(api=api, **kw)
    await model_step(turn, ModelChoice(provider, api.model))
    return turn


# --- 3: a stream cut after 40 % of its output --------------------------------


# After two of five deltas: the connection reset, or the API's 500 error event.
CUTS: dict[str, Callable[[Api], Reply]] = {
    "reset": lambda api: cut_at(api.answer(PARTS), PARTS[2]),
    "500": lambda api: api.error_mid_stream(PARTS[:2]),
}


@each_api
@pytest.mark.parametrize("cut", CUTS.values(), ids=list(CUTS))
async def test_a_stream_cut_after_40_percent_is_retried_and_its_deltas_discarded(
    api: Api, wire: WireServer, connected: WireProvider, cut: Callable[[Api], Reply]
) -> None:
    wire.queue(cut(api), api.answer(RETRIED))

    turn = await step(api, connected)

    assert len(wire.requests) == 2
    assert turn.client_text().text == "".join(RETRIED)
    marks = [e for e in turn.events if isinstance(e, TurnResumed)]
    assert [(m.reason, m.discard_from_seq) for m in marks] == [("model_retry", 1)]
    # The discarded range is the first attempt's output, its blocks closed.
    cut = turn.events[: marks[0].seq - 1]
    assert [e.type for e in cut][-1] == "content_block_stop"
    assert marks[0].discard_to_seq == len(cut)
    assert turn.messages[-1][1]["blocks"] == [{"type": "text", "text": "".join(RETRIED)}]
    assert turn.state.stage == "final"


# --- 4: a connection dropped in the middle of a tool call's JSON ---------------


@each_api
async def test_a_tool_call_cut_mid_json_is_never_run_and_the_call_is_retried(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    args = {"city": "Lisbon", "unit": "c"}
    cut = cut_at(api.tool_call("call_1", "get_weather", args), "Lisbon", inside=True)
    wire.queue(cut, api.tool_call("call_1", "get_weather", args))

    turn = await step(api, connected)

    assert len(wire.requests) == 2
    calls = [e for e in turn.events if isinstance(e, ToolCall)]
    assert [(c.tool, c.input) for c in calls] == [("get_weather", args)]
    assert [(p.name, p.input) for p in turn.state.pending] == [("get_weather", args)]
    assert turn.state.stage == "tools"


@each_api
async def test_a_cut_on_the_last_attempt_ends_the_step_with_the_partial_kept(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    wire.queue(cut_at(api.answer(PARTS), PARTS[2]))
    turn = StepTurn(api=api, attempts=1)

    with pytest.raises(BaseException) as caught:
        await model_step(turn, ModelChoice(connected, api.model))

    assert type(caught.value).__name__ == "StepInterrupted"
    assert not [e for e in turn.events if isinstance(e, TurnResumed)]
    assert turn.client_text().text == "".join(PARTS[:2])


# --- 5: a first event that is late, a stream that never stops --------------------

SHORT = CallLimits.of(
    Settings(
        model_first_event_timeout_seconds=0.3,
        model_idle_timeout_seconds=0.3,
        model_call_timeout_seconds=1.0,
    )
)


def late(api: Api) -> Reply:
    """An answer whose first byte comes 3 s after the request (10 times the limit)."""
    reply = api.answer(["Late."])
    reply.first_delay = 3.0
    return reply


@each_api
async def test_a_late_first_event_times_out_and_the_call_is_made_again(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    wire.queue(late(api), api.answer(["On ", "time."]))
    started = time.monotonic()

    events = await collect(
        stream_with_retries(connected, request(api), initial_wait=0.01, limits=SHORT)
    )

    assert time.monotonic() - started < 2.0
    assert [e.text for e in events if isinstance(e, TextChunk)] == ["On ", "time."]
    assert len(wire.requests) == 2


@each_api
async def test_a_late_first_event_is_a_retryable_timeout(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    wire.queue(late(api))

    events, error = await collect_until_error(bounded(connected.stream(request(api)), SHORT))

    assert events == []
    assert (error.code, error.retryable) == ("LLM_PROVIDER_ERROR", True)
    assert error.details == {"timeout": "first_event", "seconds": 0.3}


@each_api
async def test_an_endless_stream_ends_at_the_call_timeout_and_is_not_retried(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    wire.queue(endless(api.answer(["la "]), "la "), api.answer(["never"]))
    started = time.monotonic()

    events, error = await collect_until_error(
        stream_with_retries(connected, request(api), initial_wait=0.01, limits=SHORT)
    )

    assert 1.0 <= time.monotonic() - started < 2.5
    assert len([e for e in events if isinstance(e, TextChunk)]) > 5
    assert (error.code, error.retryable) == ("LLM_PROVIDER_ERROR", False)
    assert error.details == {"timeout": "call", "seconds": 1.0, "partial_output": True}
    assert len(wire.requests) == 1


@each_api
async def test_a_caller_that_gives_way_is_asked_before_every_attempt(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    """The learning centre waits for a shared local server before each attempt,
    retries included (holdfast_learning.extract): the hook runs before each
    request is sent, never during one."""
    wire.queue(late(api), api.answer(["On ", "time."]))
    asked: list[int] = []

    async def give_way() -> None:
        asked.append(len(wire.requests))

    events = await collect(
        stream_with_retries(
            connected, request(api), initial_wait=0.01, limits=SHORT, before_attempt=give_way
        )
    )

    assert [e.text for e in events if isinstance(e, TextChunk)] == ["On ", "time."]
    assert asked == [0, 1], "once before each of the two requests"


async def test_retry_hints_in_every_form() -> None:
    assert retry_after({"retry-after": "3"}) == 3.0
    assert retry_after({"retry-after-ms": "250", "retry-after": "3"}) == 0.25
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0
    used_up = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m30.5s"}
    assert retry_after(used_up) == 90.5
    left = {"x-ratelimit-remaining-requests": "3", "x-ratelimit-reset-requests": "20s"}
    assert retry_after(left) is None  # a reset of a limit not used up is no reason to wait
    assert retry_after({**used_up, "retry-after": "2"}) == 2.0
    assert (
        retry_after(
            {
                "anthropic-ratelimit-tokens-remaining": "0",
                "anthropic-ratelimit-tokens-reset": "2015-10-21T07:28:00Z",
            }
        )
        == 0.0
    )
    assert retry_after({}) is None


def test_the_limits_default_to_the_settings() -> None:
    assert configured_limits() == CallLimits(120.0, 120.0, 900.0)


# --- 6: malformed SSE ----------------------------------------------------------

# Invalid JSON in a data field (under an event name the SDK reads, for
# Anthropic's named events), and a line that is no SSE field at all with a
# truncated JSON behind it.
GARBAGE = {
    "bad json": SSE("{not json", event="content_block_delta"),
    "garbage line": SSE('garbage line\n\ndata: {"a"'),
}


@each_api
@pytest.mark.parametrize("garbage", GARBAGE.values(), ids=list(GARBAGE))
async def test_malformed_sse_is_a_retryable_provider_error(
    api: Api, wire: WireServer, connected: WireProvider, garbage: SSE
) -> None:
    wire.queue(garbled(api.answer(PARTS), PARTS[2], garbage))

    if api.name == "anthropic" and garbage.event is None:
        # Anthropic's SDK reads named events only: an unnamed one is skipped whole.
        events = await collect(connected.stream(request(api)))
        assert [e.text for e in events if isinstance(e, TextChunk)] == PARTS
        return
    events, error = await collect_until_error(connected.stream(request(api)))

    assert [e.text for e in events if isinstance(e, TextChunk)] == PARTS[:2]
    assert (error.code, error.retryable) == ("LLM_PROVIDER_ERROR", True)
    assert error.details == {"provider": api.name, "malformed": True}
    assert error.message.startswith(f"malformed event in the {api.name} stream")


@each_api
async def test_malformed_sse_mid_answer_is_retried_and_shown_once(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    wire.queue(garbled(api.answer(PARTS), PARTS[2], GARBAGE["bad json"]), api.answer(RETRIED))

    turn = await step(api, connected)

    assert turn.client_text().text == "".join(RETRIED)
    assert [e.reason for e in turn.events if isinstance(e, TurnResumed)] == ["model_retry"]


# --- 1-2: rate limits and overload, retried as the server says ----------------


@dataclass(frozen=True)
class Wait:
    """Failures the server answers first, and how long the retries must wait."""

    name: str
    failures: Callable[[Api], list[Reply]]
    initial_wait: float
    max_wait: float
    at_least: float
    below: float


WAITS = [
    Wait("429 retry-after 1 s", lambda api: [api.rate_limited("1")], 0.01, 30, 1.0, 5.0),
    # retry-after-ms (0.6 s) beside a retry-after of 60 s; Gemini's RetryInfo.
    Wait("the API's own hint", lambda api: [api.hinted(0.6)], 0.01, 30, 0.6, 3.0),
    # Only the rate-limit headers: the used-up limit's reset (the other's is later).
    Wait("the used-up limit's reset", lambda api: [api.reset_hinted(0.6)], 0.01, 30, 0.5, 3.0),
    Wait("retry-after 1 h, capped", lambda api: [api.rate_limited("3600")], 0.01, 0.5, 0.5, 2.0),
    # Backed off: at least 0.2 s, then 0.4 s (plus up to 1 s of jitter each).
    Wait("overloaded twice", lambda api: [api.overloaded(), api.overloaded()], 0.2, 2, 0.6, 5.0),
]


@each_api
@pytest.mark.parametrize("wait", WAITS, ids=[w.name for w in WAITS])
async def test_rate_limits_and_overload_are_retried_after_their_wait(
    api: Api, wire: WireServer, connected: WireProvider, wait: Wait
) -> None:
    failures = wait.failures(api)
    wire.queue(*failures, api.answer(["Made ", "it."]))
    started = time.monotonic()

    events = await collect(
        stream_with_retries(
            connected, request(api), initial_wait=wait.initial_wait, max_wait=wait.max_wait
        )
    )

    assert wait.at_least <= time.monotonic() - started < wait.below
    assert [e.text for e in events if isinstance(e, TextChunk)] == ["Made ", "it."]
    assert len(wire.requests) == len(failures) + 1


@each_api
async def test_overloaded_past_the_attempts_is_the_providers_error(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    wire.queue(*(api.overloaded() for _ in range(3)))

    events, error = await collect_until_error(
        stream_with_retries(connected, request(api), attempts=3, initial_wait=0.01, max_wait=0.05)
    )

    assert events == []
    overloaded = 529 if api.name == "anthropic" else 503
    assert (error.code, error.status, error.retryable) == ("LLM_PROVIDER_ERROR", overloaded, True)
    assert len(wire.requests) == 3


# --- 7: usage missing or implausible -----------------------------------------------


def usage_events(turn: StepTurn) -> list[Usage]:
    return [e for e in turn.events if isinstance(e, Usage)]


@each_api
async def test_a_plausible_usage_is_taken_as_reported(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    wire.queue(api.reporting(["Fine."], 2600))

    turn = await step(api, connected, estimate=2000)

    [usage] = usage_events(turn)
    assert usage.estimated is None
    assert usage.input_tokens == 2600
    assert turn.state.calibration == pytest.approx(1.15)  # halfway to 1.3


@each_api
@pytest.mark.parametrize("reported", [1, 50_000], ids=["constant 1", "far too many"])
async def test_an_implausible_usage_is_estimated_and_leaves_the_calibration(
    api: Api, wire: WireServer, connected: WireProvider, reported: int
) -> None:
    wire.queue(api.reporting(PARTS, reported))

    turn = await step(api, connected, estimate=2000)

    [usage] = usage_events(turn)
    assert usage.estimated is True
    assert usage.input_tokens == 2000
    assert usage.output_tokens == text_tokens("".join(PARTS))
    assert turn.state.calibration == 1.0


@each_api
async def test_a_missing_usage_is_estimated_not_zero(
    api: Api, wire: WireServer, connected: WireProvider
) -> None:
    wire.queue(without_usage(api.answer(PARTS)))

    turn = await step(api, connected, estimate=2000)

    [usage] = usage_events(turn)
    assert (usage.estimated, usage.input_tokens) == (True, 2000)
    assert usage.output_tokens > 0
    assert turn.state.calibration == 1.0


def test_the_calibration_stays_within_one_to_eight_characters_a_token() -> None:
    calibration = 1.0
    for _ in range(20):  # a constant report, call after call: ignored
        calibration = recalibrate(calibration, estimate=5000, reported=1)
    assert calibration == 1.0
    for _ in range(20):  # a real tokenizer at 2 characters a token: followed
        calibration = recalibrate(calibration, estimate=5000, reported=10_000)
    assert calibration == pytest.approx(2.0)
    # One stored before the bounds (0.25) is brought in.
    assert sane_calibration(0.25) == PLAUSIBLE[0] == 0.5
    assert sane_calibration(None) == 1.0
