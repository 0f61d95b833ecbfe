"""The learning centre gives way to the turns on a shared model endpoint (#31, 4):
one extraction call at a time (HOLDFAST_LEARNING_CONCURRENCY), each made once
no turn's model call is under way on the same endpoint, or after
HOLDFAST_LEARNING_YIELD_SECONDS. Against a real Redis."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import pytest
from holdfast_learning.extract import Extractor, Yielding
from holdfast_shared import endpoint_calls
from holdfast_shared.keys import Keys
from holdfast_shared.providers import ModelEvent, ModelRequest, ProviderRegistry
from holdfast_shared.providers.openai import OpenAIProvider
from holdfast_shared.providers.scripted import ScriptedProvider
from redis.asyncio import Redis

from tests.memory.test_learner import record

pytestmark = pytest.mark.timeout(60)


class CountingProvider(ScriptedProvider):
    """The scripted model as if served by a local server, counting the calls
    under way at once."""

    endpoint = "openai http://127.0.0.1:8080/v1/"

    def __init__(self) -> None:
        super().__init__()
        self.running = 0
        self.most = 0
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        self.running += 1
        self.calls += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.05)  # a call that takes a while, so calls could overlap
            async for event in super().stream(request):
                yield event
        finally:
            self.running -= 1


@pytest.fixture
def keys(redis_prefix: str) -> Keys:
    return Keys(f"{redis_prefix}yield-{secrets.token_hex(3)}:")


def extractor(redis: Redis, keys: Keys, at_most: float) -> tuple[Extractor, CountingProvider]:
    provider = CountingProvider()
    yielding = Yielding(redis, keys, concurrency=1, at_most_seconds=at_most)
    return Extractor(ProviderRegistry([provider]), None, yielding=yielding), provider


async def test_extraction_waits_for_the_turns_on_its_endpoint(redis: Redis, keys: Keys) -> None:
    learning, provider = extractor(redis, keys, at_most=30)
    endpoint = endpoint_calls.endpoint_of(provider)
    assert endpoint == CountingProvider.endpoint
    turn_call = endpoint_calls.calling(redis, keys, endpoint, limit_seconds=60)
    await turn_call.__aenter__()
    try:
        assert await endpoint_calls.busy(redis, keys, endpoint) == 1
        extracting = asyncio.create_task(learning.extract(record("hello"), ""))
        done, _ = await asyncio.wait({extracting}, timeout=1.0)
        assert not done and provider.calls == 0, "no extraction call while a turn calls"
    finally:
        await turn_call.__aexit__(None, None, None)
    got = await asyncio.wait_for(extracting, 20)
    assert provider.calls == 1 and got.extraction is not None
    assert await endpoint_calls.busy(redis, keys, endpoint) == 0


async def test_extraction_goes_ahead_after_waiting_its_longest(redis: Redis, keys: Keys) -> None:
    learning, provider = extractor(redis, keys, at_most=0.3)
    endpoint = endpoint_calls.endpoint_of(provider)
    async with endpoint_calls.calling(redis, keys, endpoint, limit_seconds=60):
        await asyncio.wait_for(learning.extract(record("hello"), ""), 20)
    assert provider.calls == 1


async def test_other_endpoints_do_not_hold_it_back_and_calls_go_one_at_a_time(
    redis: Redis, keys: Keys
) -> None:
    learning, provider = extractor(redis, keys, at_most=30)
    async with endpoint_calls.calling(redis, keys, "openai http://elsewhere/v1/", limit_seconds=60):
        records: list[dict[str, Any]] = [record(f"message {i}") for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(learning.extract(r, "") for r in records)), 20)
    assert provider.calls == 4
    assert provider.most == 1


def test_only_self_hosted_endpoints_count() -> None:
    hosted = OpenAIProvider(api_key="sk-x")
    local = OpenAIProvider(api_key="unused", base_url="http://127.0.0.1:11434/v1")
    assert endpoint_calls.endpoint_of(hosted) is None
    assert endpoint_calls.endpoint_of(ScriptedProvider()) is None
    assert endpoint_calls.endpoint_of(local) == "openai http://127.0.0.1:11434/v1/"


async def test_a_dead_workers_call_stops_counting_at_its_limit(redis: Redis, keys: Keys) -> None:
    endpoint = "openai http://127.0.0.1:1/v1/"
    call = endpoint_calls.calling(redis, keys, endpoint, limit_seconds=0.2)
    await call.__aenter__()  # and never left: its worker was killed
    assert await endpoint_calls.busy(redis, keys, endpoint) == 1
    waited = await endpoint_calls.wait_until_quiet(redis, keys, endpoint, at_most=10)
    assert 0.1 < waited < 5


async def test_a_small_window_gets_a_shorter_transcript_from_then_on() -> None:
    # The scripted model refuses any prompt over its window, as a local server does.
    provider = ScriptedProvider(context_window=2048)
    learning = Extractor(ProviderRegistry([provider]), None)
    long = record(*[f"message {i}: " + "words of a long turn " * 60 for i in range(40)])

    got = await asyncio.wait_for(learning.extract(long, ""), 20)

    assert got.extraction is not None
    assert learning.transcript_chars < 60_000
    assert learning.max_tokens < 4096
    kept = learning.transcript_chars
    await asyncio.wait_for(learning.extract(long, ""), 20)
    assert learning.transcript_chars == kept, "learned once"
