"""Extraction: a trajectory in, an :class:`Extraction` out, by one model call.

The prompt (``prompts/extract.md``) is the system prompt; the user message
is the current soul and the trajectory rendered as a transcript. The model
answers with a ``record_memory`` tool call (its schema is the structured
output); a reply that calls no tool but holds the JSON as text is accepted
too, since some models do that.

The learning centre gives way to the turns (#31, 4): at most
``HOLDFAST_LEARNING_CONCURRENCY`` extraction calls at once (default 1), each
made once no turn is calling the same provider endpoint (or after
``HOLDFAST_LEARNING_YIELD_SECONDS``): a local model server that serves one
request at a time, or aborts the running one for a new one, serves the
turns first (``holdfast_shared.endpoint_calls``). A model that refuses the
prompt as too long for its window gets the transcript cut to a quarter and
asks for half the answer, again down to 3,000 characters and 512 tokens, and
the extractor keeps those limits for the next trajectories.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from holdfast_shared import endpoint_calls
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.errors import ErrorCode
from holdfast_shared.keys import Keys
from holdfast_shared.providers import ProviderError, ProviderRegistry
from holdfast_shared.providers.base import (
    ModelRequest,
    TextChunk,
    ToolInputChunk,
    UsageReport,
)
from holdfast_shared.providers.calls import stream_with_retries
from pydantic import ValidationError
from redis.asyncio import Redis

from holdfast_learning.extraction import RECORD_MEMORY, Extraction

log = logging.getLogger(__name__)

# One trajectory's transcript is cut to this many characters (its head and tail).
MAX_TRANSCRIPT_CHARS = 60_000
# Each message, tool input or result inside it, at most.
_ITEM_CHARS = 2_000
# After a context overflow the transcript and the answer are asked shorter,
# down to these (a 2,048-token window holds the prompt and both).
_LEAST_TRANSCRIPT_CHARS = 3_000
_MAX_TOKENS = 4096
_LEAST_MAX_TOKENS = 512


def prompt() -> str:
    return (resources.files("holdfast_learning") / "prompts" / "extract.md").read_text("utf-8")


class ExtractionFailed(Exception):
    """The model's answer could not be used (the trajectory is retried)."""


@dataclass(frozen=True, slots=True)
class Extracted:
    extraction: Extraction
    usage: dict[str, int]
    model_seconds: float


def _cut(value: Any, limit: int = _ITEM_CHARS) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[: limit - 20]} … [{len(text)} chars]"


def _blocks_text(content: dict[str, Any]) -> str:
    return " ".join(
        str(b.get("text", "")) for b in content.get("blocks", []) if b.get("type") == "text"
    )


def render(record: dict[str, Any], soul: str, limit: int = MAX_TRANSCRIPT_CHARS) -> str:
    """The trajectory as the extractor reads it (the scripted extractor parses
    this too), at most ``limit`` characters (its head and tail)."""
    task = record.get("task") or {}
    outcome = record.get("outcome") or {}
    lines = [
        "## Current soul",
        soul.strip() or "(none)",
        "",
        f"## Trajectory {record.get('turn_id', '')}",
        f"Task: {task.get('name') or task.get('id') or ''}",
        f"Outcome: {outcome.get('status', 'completed')}"
        + (f" ({outcome['stop_reason']})" if outcome.get("stop_reason") else ""),
        f"When: {(record.get('timings') or {}).get('started_at', '')}",
    ]
    if outcome.get("error"):
        lines.append(f"Error: {_cut(outcome['error'])}")
    calls = {c["id"]: c for c in record.get("tool_calls") or [] if "id" in c}
    for message in record.get("messages") or []:
        content = message.get("content") or {}
        if message.get("role") == "user":
            text = _blocks_text(content)
            if text:
                lines.append(f"User: {_cut(text)}")
            for block in content.get("blocks", []):
                if block.get("type") == "tool_result":
                    result = block.get("error") or block.get("output")
                    lines.append(f"Tool result: {_cut(result, 500)}")
        else:
            text = _blocks_text(content)
            if text:
                lines.append(f"Agent: {_cut(text)}")
            for block in content.get("blocks", []):
                if block.get("type") == "tool_use":
                    call = calls.get(block.get("id", ""), {})
                    lines.append(
                        f"Agent called {block.get('name')}: {_cut(block.get('input'), 500)}"
                        + (" (failed)" if call.get("error") else "")
                    )
    for question in record.get("hitl") or []:
        lines.append(
            f"Agent asked the user ({question.get('kind')}): {_cut(question.get('question'))} "
            f"— answer: {_cut(question.get('answer') or question.get('status'))}"
            + (f"; feedback: {_cut(question['feedback'])}" if question.get("feedback") else "")
        )
    text = "\n".join(lines)
    if len(text) > limit:
        half = limit // 2
        text = f"{text[:half]}\n[… {len(text) - 2 * half} characters left out …]\n{text[-half:]}"
    return text


def parse(tool_input: str, text: str) -> Extraction:
    raw = tool_input or text.strip()
    if raw.startswith("```"):
        raw = raw.strip("`").removeprefix("json").strip()
    try:
        return Extraction.model_validate_json(raw)
    except ValidationError as exc:
        raise ExtractionFailed(f"the model's extraction is invalid: {exc.errors()[:3]}") from exc


@dataclass(frozen=True, slots=True)
class Yielding:
    """How extraction gives way to the turns on a shared endpoint."""

    redis: Redis
    keys: Keys
    concurrency: int = 1  # HOLDFAST_LEARNING_CONCURRENCY
    at_most_seconds: float = 600.0  # HOLDFAST_LEARNING_YIELD_SECONDS


class Extractor:
    """Runs extraction calls on ``HOLDFAST_LEARNING_MODEL`` (default: the default model)."""

    def __init__(
        self,
        providers: ProviderRegistry,
        model: str | None,
        *,
        attempts: int = 3,
        yielding: Yielding | None = None,
    ) -> None:
        self.choice = providers.resolve(model)
        self.attempts = attempts
        self.system = prompt()
        self.yielding = yielding
        self._slots = asyncio.Semaphore(yielding.concurrency if yielding else 1)
        self.endpoint = endpoint_calls.endpoint_of(self.choice.provider)
        # Lowered for good when the model refuses a prompt as too long (a
        # local model's small window): later trajectories fit at once.
        self.transcript_chars = MAX_TRANSCRIPT_CHARS
        self.max_tokens = _MAX_TOKENS

    @property
    def model(self) -> str:
        return f"{self.choice.provider.name}:{self.choice.model}"

    async def extract(self, record: dict[str, Any], soul: str) -> Extracted:
        async with self._slots:
            while True:
                try:
                    return await self._extract(record, soul)
                except ProviderError as exc:
                    if exc.code != ErrorCode.CONTEXT_OVERFLOW or not self._shrink():
                        raise
                    log.warning(
                        "%s found an extraction prompt too long: transcripts now cut to %d "
                        "characters, answers to %d tokens",
                        self.model,
                        self.transcript_chars,
                        self.max_tokens,
                    )

    def _shrink(self) -> bool:
        """Ask for less (a quarter of the transcript, half the answer); False
        when already at the least."""
        if self.transcript_chars <= _LEAST_TRANSCRIPT_CHARS:
            return False
        self.transcript_chars = max(_LEAST_TRANSCRIPT_CHARS, self.transcript_chars // 4)
        self.max_tokens = max(_LEAST_MAX_TOKENS, self.max_tokens // 2)
        return True

    async def _give_way(self) -> None:
        """Wait while turns call this endpoint (at most ``at_most_seconds``)."""
        if self.yielding is None or self.endpoint is None:
            return
        y = self.yielding
        waited = await endpoint_calls.wait_until_quiet(
            y.redis, y.keys, self.endpoint, at_most=y.at_most_seconds
        )
        if waited >= 1:
            log.info("extraction waited %.1f s for the turns on %s", waited, self.endpoint)

    async def _extract(self, record: dict[str, Any], soul: str) -> Extracted:
        request = ModelRequest(
            model=self.choice.model,
            system=self.system,
            messages=(
                ChatMessage(
                    "user",
                    ({"type": "text", "text": render(record, soul, self.transcript_chars)},),
                ),
            ),
            tools=(RECORD_MEMORY,),
            max_tokens=self.max_tokens,
            purpose="extraction",
        )
        started = time.perf_counter()
        tool_input: list[str] = []
        text: list[str] = []
        usage: dict[str, int] = {}
        # Gives way before each attempt, not only the first: a retry made at
        # once would cut off the turn that just took the server back.
        stream = stream_with_retries(
            self.choice.provider, request, attempts=self.attempts, before_attempt=self._give_way
        )
        async for event in stream:
            if isinstance(event, ToolInputChunk):
                tool_input.append(event.partial_json)
            elif isinstance(event, TextChunk):
                text.append(event.text)
            elif isinstance(event, UsageReport):
                usage = {
                    "input_tokens": event.input_tokens,
                    "output_tokens": event.output_tokens,
                }
        extraction = parse("".join(tool_input), "".join(text))
        return Extracted(extraction, usage, time.perf_counter() - started)
