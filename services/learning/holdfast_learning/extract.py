"""Extraction: a trajectory in, an :class:`Extraction` out, by one model call.

The prompt (``prompts/extract.md``) is the system prompt; the user message
is the current soul and the trajectory rendered as a transcript. The model
answers with a ``record_memory`` tool call (its schema is the structured
output); a reply that calls no tool but holds the JSON as text is accepted
too, since some models do that.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers import ProviderRegistry
from holdfast_shared.providers.base import (
    ModelRequest,
    TextChunk,
    ToolInputChunk,
    UsageReport,
)
from holdfast_shared.providers.retry import stream_with_retries
from pydantic import ValidationError

from holdfast_learning.extraction import RECORD_MEMORY, Extraction

# One trajectory's transcript is cut to this many characters (its head and tail).
MAX_TRANSCRIPT_CHARS = 60_000
# Each message, tool input or result inside it, at most.
_ITEM_CHARS = 2_000


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


def render(record: dict[str, Any], soul: str) -> str:
    """The trajectory as the extractor reads it (the scripted extractor parses this too)."""
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
    if len(text) > MAX_TRANSCRIPT_CHARS:
        half = MAX_TRANSCRIPT_CHARS // 2
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


class Extractor:
    """Runs extraction calls on ``HOLDFAST_LEARNING_MODEL`` (default: the default model)."""

    def __init__(
        self, providers: ProviderRegistry, model: str | None, *, attempts: int = 3
    ) -> None:
        self.choice = providers.resolve(model)
        self.attempts = attempts
        self.system = prompt()

    @property
    def model(self) -> str:
        return f"{self.choice.provider.name}:{self.choice.model}"

    async def extract(self, record: dict[str, Any], soul: str) -> Extracted:
        request = ModelRequest(
            model=self.choice.model,
            system=self.system,
            messages=(ChatMessage("user", ({"type": "text", "text": render(record, soul)},)),),
            tools=(RECORD_MEMORY,),
            max_tokens=4096,
            purpose="extraction",
        )
        started = time.perf_counter()
        tool_input: list[str] = []
        text: list[str] = []
        usage: dict[str, int] = {}
        stream = stream_with_retries(self.choice.provider, request, attempts=self.attempts)
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
