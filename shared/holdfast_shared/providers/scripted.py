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
  model's; ``"stamp": true`` makes each delta's text ``@<time.time()>``
  as it is yielded (the bench's capacity row times provider → client
  with it); ``fail`` raises a provider error with that message after the
  deltas, to exercise error paths. Text after the object is ignored by the
  script (it is still the message the turn's memories are looked up by).

* ``{"echo_notes": true}`` answers with the request's notes (working and
  retrieved memory) as the model saw them.
* ``{"echo_request": true}`` answers with what the request was made of, as
  JSON: ``{"model", "system", "tools", "soul"}`` (the system prompt, the
  names of the tools offered, and the soul block), so tests can see the
  turn's agent reach the model.
* A summary call (``purpose="summary"``, the context engine compacting)
  gets a short summary: how many messages, and the start of each user
  message, within the call's ``max_tokens``; after ``SCRIPTED_SUMMARY_DELAY_MS``
  when set (to catch a worker in the middle of one).
* A learning call (``purpose="extraction"``) gets a ``record_memory`` tool
  call with memories extracted by fixed rules (``scripted_learning.py``),
  after ``SCRIPTED_EXTRACTION_DELAY_MS`` when set.
* A skill's sub-call (``purpose="skill"``, the skill tool with ``input``)
  answers ``Skill <name> says: <input>``, the name read from the system
  prompt the skill tool writes (``holdfast_shared.skills.disclosure``).
* When the request carries an engine summary of earlier turns, the echo
  ends with ``[summary in context]``, so tests can see the model got it.
* With an output schema (``output_schema``, ``structured.py``) the answer is
  the script's ``"result"`` as JSON, or with ``"results": [first, second,
  ...]`` the one for this attempt (the first, then the next after each
  correction the loop-worker sends; the last repeats), so tests can answer
  wrongly, then rightly; ``delay_ms`` paces its words. A script's
  ``tool_calls`` are made first; without ``result`` the answer is the echo,
  which no schema of an object accepts.

It counts a request's size the way the context engine estimates it (four
characters a token) and reports it as ``input_tokens``; with
``SCRIPTED_CONTEXT_WINDOW`` set it refuses a larger request the way real
APIs do (``CONTEXT_OVERFLOW``), so tests can prove every request fits.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from holdfast_shared.providers.base import (
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
from holdfast_shared.providers.scripted_learning import FAIL_MARK
from holdfast_shared.providers.scripted_learning import extract as extract_memories
from holdfast_shared.providers.structured import wanted as structured_output

SCRIPT_PREFIX = "/script"
# Milliseconds an extraction call takes (tests catch the learning service mid-batch).
EXTRACTION_DELAY_ENV = "SCRIPTED_EXTRACTION_DELAY_MS"


def _words(text: str) -> list[str]:
    # Keep the spaces with the words so the deltas concatenate to the text.
    return re.findall(r"\S+\s*|\s+", text) or [text]


def _count_tokens(text: str) -> int:
    return len(text.split())


CONTEXT_WINDOW_ENV = "SCRIPTED_CONTEXT_WINDOW"
SUMMARY_DELAY_ENV = "SCRIPTED_SUMMARY_DELAY_MS"
_SUMMARY_MARK = "# Earlier in this task"


def request_tokens(request: ModelRequest) -> int:
    """The request's size in the engine's own estimate (four characters a token)."""
    chars = len(request.system) + len(request.soul) + len(request.notes)
    for message in request.messages:
        chars += len(json.dumps(message.blocks, default=str)) + 16
    for tool in request.tools:
        chars += len(tool.name) + len(tool.description) + len(json.dumps(tool.input_schema))
    return chars // 4


class ScriptedProvider:
    name = "scripted"

    def __init__(
        self,
        *,
        context_window: int | None = None,
        summary_delay_ms: int = 0,
        extraction_delay_ms: int = 0,
    ) -> None:
        self.context_window = context_window
        self.summary_delay_ms = summary_delay_ms
        self.extraction_delay_ms = extraction_delay_ms

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ScriptedProvider:
        window = environ.get(CONTEXT_WINDOW_ENV)
        return cls(
            context_window=int(window) if window else None,
            summary_delay_ms=int(environ.get(SUMMARY_DELAY_ENV) or 0),
            extraction_delay_ms=int(environ.get(EXTRACTION_DELAY_ENV) or 0),
        )

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelEvent]:
        size = request_tokens(request)
        if self.context_window is not None and size > self.context_window:
            raise ProviderError(
                "CONTEXT_OVERFLOW",
                f"prompt is too long: {size} tokens > {self.context_window} maximum",
            )
        if request.purpose == "extraction":
            async for event in self._extraction(request, size):
                yield event
            return
        if request.purpose == "skill":
            async for event in self._skill(request, size):
                yield event
            return
        if request.purpose == "summary":
            if self.summary_delay_ms:
                await asyncio.sleep(self.summary_delay_ms / 1000)
            async for event in self._summary(request, size):
                yield event
            return
        last = request.messages[-1] if request.messages else None
        results = [b for b in (last.blocks if last else ()) if b.get("type") == "tool_result"]
        user_messages = [m for m in request.messages if m.role == "user" and m.text]
        latest = user_messages[-1].text if user_messages else ""
        script: dict[str, Any]
        if structured_output(request) is not None:
            script = self._answer(request, calls_done=bool(results))
        elif results:
            summary = [
                {k: r.get(k) for k in ("output", "error") if r.get(k) is not None} for r in results
            ]
            script = {"text": "Tool results: " + json.dumps(summary)}
        else:
            script = self._script(latest, [m.text for m in user_messages[:-1]])
            if script.get("echo_notes"):
                script["text"] = request.notes or "(no notes)"
            elif script.get("echo_request"):
                script["text"] = json.dumps(
                    {
                        "model": request.model,
                        "system": request.system,
                        "tools": [tool.name for tool in request.tools],
                        "soul": request.soul,
                    }
                )
            elif _SUMMARY_MARK in request.soul and "text" in script and "deltas" not in script:
                script["text"] = f"{script['text']} [summary in context]"
        delay = float(script.get("delay_ms", 0)) / 1000
        stamp = bool(script.get("stamp"))
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
                # "stamp": the delta carries when it left the provider (wall
                # clock, shared by every process here), for latency benchmarks.
                yield TextChunk(index, f"@{time.time():.6f}" if stamp else chunk)
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

        yield UsageReport(input_tokens=size, output_tokens=output_tokens)
        yield Finish("tool_use" if calls else str(script.get("stop_reason", "end_turn")))

    @staticmethod
    async def _summary(request: ModelRequest, size: int) -> AsyncIterator[ModelEvent]:
        prompt = request.messages[-1].text if request.messages else ""
        users = re.findall(r"^User: (.{0,60})", prompt, flags=re.MULTILINE)
        text = f"Summary of {prompt.count(chr(10) + chr(10))} entries. The user said: " + "; ".join(
            users
        )
        text = text[: request.max_tokens * 4]
        yield BlockStart(0, "text")
        yield TextChunk(0, text)
        yield BlockStop(0)
        yield UsageReport(input_tokens=size, output_tokens=len(text) // 4)
        yield Finish("end_turn")

    @staticmethod
    async def _skill(request: ModelRequest, size: int) -> AsyncIterator[ModelEvent]:
        named = re.search(r'the skill "([a-z0-9-]+)"', request.system)
        given = request.messages[-1].text if request.messages else ""
        text = f"Skill {named[1] if named else '?'} says: {given}"
        yield BlockStart(0, "text")
        for word in _words(text):
            yield TextChunk(0, word)
        yield BlockStop(0)
        yield UsageReport(input_tokens=size, output_tokens=_count_tokens(text))
        yield Finish("end_turn")

    async def _extraction(self, request: ModelRequest, size: int) -> AsyncIterator[ModelEvent]:
        prompt = request.messages[-1].text if request.messages else ""
        if self.extraction_delay_ms:
            await asyncio.sleep(self.extraction_delay_ms / 1000)
        if FAIL_MARK in prompt:
            raise ProviderError("LLM_PROVIDER_ERROR", "scripted extraction failure")
        payload = json.dumps(extract_memories(prompt))
        yield BlockStart(0, "tool_use", tool_name="record_memory", tool_call_id="call_extract")
        yield ToolInputChunk(0, payload)
        yield BlockStop(0)
        yield UsageReport(input_tokens=size, output_tokens=len(payload) // 4)
        yield Finish("tool_use")

    @classmethod
    def _answer(cls, request: ModelRequest, *, calls_done: bool) -> dict[str, Any]:
        """The script's structured answer for this attempt (``result``/``results``)."""
        said = [m.text for m in request.messages if m.role == "user" and m.text]
        scripted = [i for i, text in enumerate(said) if text.startswith(SCRIPT_PREFIX)]
        start = scripted[-1] if scripted else len(said) - 1
        script = cls._script(said[start] if said else "", said[:start])
        # Messages after the script's are the loop-worker's corrections.
        attempt = len(said) - 1 - start
        if script.get("tool_calls") and not calls_done and attempt == 0:
            return {"tool_calls": script["tool_calls"]}
        # delay_ms paces the answer's words, as any script's (tests kill a worker mid-answer).
        paced = {"delay_ms": script["delay_ms"]} if "delay_ms" in script else {}
        if script.get("results"):
            answers = list(script["results"])
            return {"text": json.dumps(answers[min(attempt, len(answers) - 1)]), **paced}
        if "result" in script:
            return {"text": json.dumps(script["result"]), **paced}
        return {"text": script.get("text", ""), **paced}

    @staticmethod
    def _script(latest: str, earlier: list[str]) -> dict[str, Any]:
        if latest.startswith(SCRIPT_PREFIX):
            try:
                # Words after the object are the message's own (what memory is looked up by).
                script, _end = json.JSONDecoder().raw_decode(latest[len(SCRIPT_PREFIX) :].lstrip())
            except json.JSONDecodeError as exc:
                return {"text": f"Invalid /script JSON: {exc}"}
            if isinstance(script, dict):
                return script
            return {"text": "Invalid /script: expected a JSON object"}
        reply = f"You said: {latest}"
        if earlier:
            reply += f" Earlier you said: {earlier[-1]}"
        return {"text": reply}
