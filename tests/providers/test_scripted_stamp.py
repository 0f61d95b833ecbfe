"""The scripted provider's ``stamp`` option, which the bench's capacity row times deltas by."""

from __future__ import annotations

import json
import time

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers.base import ModelRequest, TextChunk
from holdfast_shared.providers.scripted import ScriptedProvider


def _request(script: dict[str, object]) -> ModelRequest:
    message = ChatMessage("user", ({"type": "text", "text": "/script " + json.dumps(script)},))
    return ModelRequest(model="scripted", system="", messages=(message,))


async def _texts(script: dict[str, object]) -> list[str]:
    provider = ScriptedProvider()
    return [e.text async for e in provider.stream(_request(script)) if isinstance(e, TextChunk)]


async def test_stamped_deltas_carry_the_time_they_were_yielded() -> None:
    before = time.time()
    texts = await _texts({"text": "x", "deltas": 3, "delay_ms": 5, "stamp": True})
    after = time.time()
    assert len(texts) == 3
    stamps = [float(t.removeprefix("@")) for t in texts]
    assert all(t.startswith("@") for t in texts)
    assert before <= stamps[0] <= stamps[1] <= stamps[2] <= after
    assert stamps[2] - stamps[0] >= 0.009  # the delays lie between them


async def test_without_stamp_the_deltas_are_the_text() -> None:
    assert await _texts({"text": "x", "deltas": 3}) == ["x", "x", "x"]
