"""The ``scripted`` provider: deterministic replies with no network, for tests and demos.

It goes through the same code path as a real provider. What it answers:

* By default it echoes: ``You said: <message>``, and when the task has an
  earlier user message, ``Earlier you said: <that message>`` — so a second
  turn visibly sees the first. Words stream as separate text deltas.
* A message that starts with ``/script`` followed by a JSON object is a
  script instead::

      /script {"thinking": "...", "text": "...", "deltas": 100,
               "delay_ms": 5, "stop_reason": "end_turn", "fail": "..."}

  ``thinking`` streams a thinking block first; ``text`` is split into words,
  or repeated ``deltas`` times when that is given (benchmarks use this);
  ``delay_ms`` pauses between deltas; ``stop_reason`` is reported as the
  model's; ``fail`` raises a provider error with that message after the
  deltas, to exercise error paths.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import AsyncIterator
from typing import Any

from holdfast_loop_worker.providers.base import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    ModelRequest,
    ProviderError,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    UsageReport,
)

SCRIPT_PREFIX = "/script"


def _words(text: str) -> list[str]:
    # Keep the spaces with the words so the deltas concatenate to the text.
    return re.findall(r"\S+\s*|\s+", text) or [text]


def _count_tokens(text: str) -> int:
    return len(text.split())


class ScriptedProvider:
    name = "scripted"

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        last = request.messages[-1] if request.messages else None
        results = [b for b in (last.blocks if last else ()) if b.get("type") == "tool_result"]
        user_messages = [m for m in request.messages if m.role == "user" and m.text]
        latest = user_messages[-1].text if user_messages else ""
        if results:
            summary = [
                {k: r.get(k) for k in ("output", "error") if r.get(k) is not None} for r in results
            ]
            script: dict[str, Any] = {"text": "Tool results: " + json.dumps(summary)}
        else:
            script = self._script(latest, [m.text for m in user_messages[:-1]])
        delay = float(script.get("delay_ms", 0)) / 1000
        index = 0
        output_tokens = 0

        thinking = script.get("thinking")
        if thinking:
            yield BlockStart(index, "thinking")
            for word in _words(str(thinking)):
                yield ThinkingChunk(index, word)
            yield BlockStop(index, signature="scripted")
            output_tokens += _count_tokens(str(thinking))
            index += 1

        text = str(script.get("text", ""))
        if "deltas" in script:
            chunks = [text] * int(script["deltas"])
        else:
            chunks = _words(text) if text else []
        if chunks:
            yield BlockStart(index, "text")
            for chunk in chunks:
                if delay:
                    await asyncio.sleep(delay)
                yield TextChunk(index, chunk)
            if script.get("fail"):
                # Mid-block, the way a dropped connection breaks a real stream.
                raise ProviderError("LLM_PROVIDER_ERROR", str(script["fail"]), retryable=True)
            yield BlockStop(index)
            output_tokens += sum(_count_tokens(c) for c in chunks)
        else:
            index -= 1  # no text block: tool blocks number from here

        if script.get("fail"):
            raise ProviderError("LLM_PROVIDER_ERROR", str(script["fail"]), retryable=True)

        calls = script.get("tool_calls") or []
        for call in calls:
            index += 1
            yield BlockStart(
                index,
                "tool_use",
                tool_name=str(call["name"]),
                tool_call_id=f"call_{secrets.token_hex(8)}",
            )
            yield ToolInputChunk(index, json.dumps(call.get("input", {})))
            yield BlockStop(index)

        input_tokens = sum(_count_tokens(m.text) for m in request.messages)
        input_tokens += _count_tokens(request.system)
        yield UsageReport(input_tokens=input_tokens, output_tokens=output_tokens)
        yield Finish("tool_use" if calls else str(script.get("stop_reason", "end_turn")))

    @staticmethod
    def _script(latest: str, earlier: list[str]) -> dict[str, Any]:
        if latest.startswith(SCRIPT_PREFIX):
            try:
                script = json.loads(latest[len(SCRIPT_PREFIX) :])
            except json.JSONDecodeError as exc:
                return {"text": f"Invalid /script JSON: {exc}"}
            if isinstance(script, dict):
                return script
            return {"text": "Invalid /script: expected a JSON object"}
        reply = f"You said: {latest}"
        if earlier:
            reply += f" Earlier you said: {earlier[-1]}"
        return {"text": reply}
