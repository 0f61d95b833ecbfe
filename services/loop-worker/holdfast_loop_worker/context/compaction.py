"""Compaction: when a call would not fit, the oldest turns become a summary.

Before a model call whose context would pass ``HOLDFAST_COMPACTION_THRESHOLD``
of the window, the orchestrator (the turn, through :class:`Compactor`) picks
a cut (:func:`plan`): the newest messages are kept verbatim, everything
older — the previous summary included — is summarized by a model call
(``HOLDFAST_COMPACTION_MODEL``, default the turn's model) told to keep
decisions, facts, open to-dos, names and file paths.

The cut never separates a tool use from its result: the first message kept
is either a user message that opens a turn, or a model message whose
preceding user message (its tool results) goes into the summary with the
call it answers. Every provider rejects a result without its call.

A summary covers every message with ``id <= last_message_id``; it is stored
before the call goes on (``context_summaries``, one per range), and the
messages stay for replay and export. A worker killed during compaction
leaves either nothing, and the turn taken over makes the summary again, or
a stored summary it finds and uses: never two summaries for one range.

A transcript too large for one summary call (a context that already
overflowed) is summarized in parts, each folded into the summary so far, so
compaction itself never needs more than the window.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from holdfast_shared.branches import summary_still_current
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.db.models import ContextSummary
from holdfast_shared.providers.base import (
    ModelRequest,
    Provider,
    ProviderError,
    TextChunk,
    UsageReport,
)
from holdfast_shared.providers.calls import stream_with_retries
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.context import tokens
from holdfast_loop_worker.context.assembly import Summary, message_tokens

log = logging.getLogger(__name__)

SUMMARY_PROMPT = (
    "You compress the history of a conversation between a user and an AI agent that uses "
    "tools, so the agent can go on with the task without the full history. Write a summary "
    "that keeps, precisely: what the user asked for and every decision made; facts learned "
    "(numbers, results, errors and their causes); names of people, projects and things; "
    "file paths, commands and identifiers exactly as written; what was done, and what is "
    "still open (to-dos, unanswered questions). Leave out pleasantries and repetition. "
    'Write in the third person ("The user asked…", "The agent found…"), as plain '
    "prose and short lists. Do not address the user and do not continue the conversation."
)
# Of a summary call's own prompt, at most this share of the window is transcript.
_TRANSCRIPT_SHARE = 0.5
# Each tool input or result in a transcript is cut to this many characters.
_TRANSCRIPT_VALUE_CHARS = 2_000
# A summary holding the instructions' first this many words repeats them.
_ECHO_WORDS = 12
# What an extracted summary keeps of each message.
_EXTRACT_CHARS = 200


@dataclass(frozen=True, slots=True)
class Plan:
    """What to summarize: ``messages`` (oldest first), up to ``last_message_id``."""

    messages: tuple[ChatMessage, ...]
    last_message_id: int
    kept: int


def plan(
    view: Sequence[ChatMessage], *, keep_tokens: int, summarized_through: int = 0
) -> Plan | None:
    """The cut that keeps the newest messages within ``keep_tokens``, or as
    close as a safe cut allows; None when nothing can be summarized (fewer
    than two messages before the first safe cut).

    ``view`` is what the model sees now: the messages after the current
    summary, which covers ids up to ``summarized_through`` (a turn's opener
    shown again is among those, and is not summarized twice).
    """
    start = 0
    while start < len(view) and view[start].id and view[start].id <= summarized_through:
        start += 1
    candidates = [i for i in range(start + 2, len(view)) if view[i - 1].id and _safe_cut(view, i)]
    if not candidates:
        return None
    tail_tokens = [0] * (len(view) + 1)
    for i in range(len(view) - 1, -1, -1):
        tail_tokens[i] = tail_tokens[i + 1] + message_tokens(view[i])
    fitting = [i for i in candidates if tail_tokens[i] <= keep_tokens]
    cut = min(fitting) if fitting else max(candidates)
    summarized = tuple(view[start:cut])
    return Plan(summarized, summarized[-1].id, len(view) - cut)


def _safe_cut(view: Sequence[ChatMessage], i: int) -> bool:
    first = view[i]
    if first.role == "user":
        # A turn's own message: never a tool result, whose call would be cut off.
        return not any(b.get("type") == "tool_result" for b in first.blocks)
    # The model's message: the user message before it answers every call before that.
    return view[i - 1].role == "user"


def transcript(messages: Sequence[ChatMessage]) -> list[str]:
    """The messages as plain text, one entry per message, for a summary call."""
    out = []
    for message in messages:
        lines = []
        for block in message.blocks:
            kind = block.get("type")
            if kind == "text" and block.get("text"):
                lines.append(str(block["text"]))
            elif kind == "tool_use":
                lines.append(f"[calls {block.get('name')}({_cut(block.get('input'))})]")
            elif kind == "tool_result":
                if block.get("error"):
                    lines.append(f"[tool error: {_cut(block['error'])}]")
                else:
                    lines.append(f"[tool result: {_cut(block.get('output'))}]")
        for item in message.media:
            lines.append(
                f"[attached {item.get('type')} {item.get('name') or item.get('media_type')}]"
            )
        if lines:
            speaker = "User" if message.role == "user" else "Agent"
            out.append(f"{speaker}: " + "\n".join(lines))
    return out


def _cut(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if len(text) <= _TRANSCRIPT_VALUE_CHARS:
        return text
    return text[:_TRANSCRIPT_VALUE_CHARS] + f"… ({len(text)} characters)"


@dataclass(frozen=True, slots=True)
class Summarized:
    text: str
    usage: dict[str, int]


async def summarize(
    provider: Provider,
    model: str,
    previous: str | None,
    messages: Sequence[ChatMessage],
    *,
    window: int,
    max_tokens: int,
    attempts: int = 4,
) -> Summarized:
    """A summary of ``previous`` (the summary so far) and ``messages``, by one
    or more calls of ``model``: a transcript larger than a call can take is
    folded in part by part."""
    budget = max(256, int(window * _TRANSCRIPT_SHARE)) - tokens.text_tokens(SUMMARY_PROMPT)
    entries = transcript(messages)
    usage: dict[str, int] = {}
    summary = previous
    part: list[str] = []
    size = tokens.text_tokens(summary or "")
    for entry in entries:
        entry_tokens = tokens.text_tokens(entry)
        if part and size + entry_tokens > budget:
            summary = await _one_call(provider, model, summary, part, max_tokens, attempts, usage)
            part, size = [], tokens.text_tokens(summary)
        # An entry larger than a whole call is cut (it was cut for the context too).
        part.append(entry[: budget * tokens.CHARS_PER_TOKEN])
        size += min(entry_tokens, budget)
    if part or summary is None:
        summary = await _one_call(provider, model, summary, part, max_tokens, attempts, usage)
    return Summarized(summary, usage)


async def _one_call(
    provider: Provider,
    model: str,
    previous: str | None,
    entries: list[str],
    max_tokens: int,
    attempts: int,
    usage: dict[str, int],
) -> str:
    parts = []
    if previous:
        parts.append("Summary of the conversation so far:\n" + previous)
    parts.append(
        ("The conversation continued:\n\n" if previous else "The conversation:\n\n")
        + "\n\n".join(entries)
    )
    parts.append("Write the updated summary of the whole conversation.")
    request = ModelRequest(
        model=model,
        system=SUMMARY_PROMPT,
        messages=(ChatMessage("user", ({"type": "text", "text": "\n\n".join(parts)},)),),
        max_tokens=max_tokens,
        purpose="summary",
    )
    text: list[str] = []
    async for event in stream_with_retries(provider, request, attempts=attempts):
        if isinstance(event, TextChunk):
            text.append(event.text)
        elif isinstance(event, UsageReport):
            for name in ("input_tokens", "output_tokens"):
                usage[name] = usage.get(name, 0) + getattr(event, name)
    summary = "".join(text).strip()
    if not summary:
        raise ProviderError("LLM_PROVIDER_ERROR", "the summary call returned no text")
    if echoes_instructions(summary):
        # A small local model (Gemma 3 270M in a real trial) answered with its
        # instructions; kept, that "summary" became every later answer.
        log.warning("%s answered the summary call with its instructions: extracted instead", model)
        return extracted(previous, entries, max_tokens)
    return summary


def echoes_instructions(summary: str) -> bool:
    """Whether ``summary`` repeats the summary call's instructions."""
    opening = " ".join(SUMMARY_PROMPT.split()[:_ECHO_WORDS]).lower()
    return opening in " ".join(summary.split()).lower()


def extracted(previous: str | None, entries: Sequence[str], max_tokens: int) -> str:
    """A summary made without a model: the start of each transcript entry, the
    latest kept first when they do not all fit in ``max_tokens``."""
    room = max_tokens * tokens.CHARS_PER_TOKEN
    lines = [entry[:_EXTRACT_CHARS].replace("\n", " ") for entry in entries]
    kept: list[str] = []
    for line in reversed(lines):
        if sum(len(k) + 1 for k in kept) + len(line) > room:
            break
        kept.insert(0, line)
    useful = previous and not echoes_instructions(previous) and len(previous) < room // 2
    head = f"{previous}\n\n" if useful else ""
    return head + "The conversation, in short (each message's start):\n" + "\n".join(kept)


class Summaries:
    """The stored summaries of tasks (``context_summaries``)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    @staticmethod
    async def latest(session: AsyncSession, task_id: str) -> Summary | None:
        row = (
            await session.execute(
                select(ContextSummary.last_message_id, ContextSummary.summary)
                # A summary of messages an edit or rollback took off the
                # branch would bring them back: only current ones count.
                .where(ContextSummary.task_id == task_id, summary_still_current())
                .order_by(ContextSummary.last_message_id.desc())
                .limit(1)
            )
        ).first()
        return None if row is None else Summary(row[0], row[1])

    async def find(self, task_id: str, last_message_id: int) -> Summary | None:
        async with self.sessions() as session:
            text = await session.scalar(
                select(ContextSummary.summary).where(
                    ContextSummary.task_id == task_id,
                    ContextSummary.last_message_id == last_message_id,
                    summary_still_current(),
                )
            )
        return None if text is None else Summary(last_message_id, text)

    async def store(
        self,
        task_id: str,
        summary: Summary,
        *,
        summarized_messages: int,
        summary_tokens: int,
        tokens_before: int,
        tokens_after: int,
        model: str,
    ) -> tuple[Summary, bool]:
        """Store ``summary``; when another worker stored one for the same range
        first, that one is returned instead (and False)."""
        async with self.sessions.begin() as session:
            created = await session.scalar(
                insert(ContextSummary)
                .values(
                    task_id=task_id,
                    last_message_id=summary.last_message_id,
                    summary=summary.text,
                    summarized_messages=summarized_messages,
                    summary_tokens=summary_tokens,
                    tokens_before=tokens_before,
                    tokens_after=tokens_after,
                    model=model,
                )
                .on_conflict_do_nothing(index_elements=["task_id", "last_message_id"])
                .returning(ContextSummary.id)
            )
        if created is not None:
            return summary, True
        found = await self.find(task_id, summary.last_message_id)
        return (found or summary), False
