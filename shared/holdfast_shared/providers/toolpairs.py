"""Tool calls and their results, kept in pairs before a history is rendered.

Every API refuses (400) a history where a tool call is not answered in the
very next message, or a result answers no call of the message before it.
The stored history can hold such a split: a turn cancelled, parked past its
deadline or cut off by a broken stream after the model asked for a tool
stores the call but never its result, and the next turn's user message
follows it. Sent as it is, that history would fail every later turn of the
task.

:func:`paired` mends it, the same way for every provider and the same way
on every call (so a prompt cache's prefix stays as it was): a call with no
result gets one saying it never ran, placed first in the user message after
it (a user message of its own when none follows); a result with no call in
the message before it is left out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from holdfast_shared.conversation import ChatMessage

NOT_RUN = "the tool call did not run: the turn ended before its result was recorded"


def paired(messages: Iterable[ChatMessage]) -> list[ChatMessage]:
    """``messages`` with every tool call answered by the next message, and no stray result."""
    out: list[ChatMessage] = []
    calls: list[str] = []  # calls of the last assistant message, not answered yet
    for message in messages:
        if message.role == "assistant":
            if calls:
                out.append(_not_run(calls, message.turn_id))
            out.append(message)
            calls = [b["id"] for b in message.blocks if b.get("type") == "tool_use"]
            continue
        answers = [b for b in message.blocks if b.get("type") == "tool_result"]
        if not answers and not calls:
            out.append(message)
            continue
        kept = [b for b in answers if b.get("tool_use_id") in calls]
        answered = {b.get("tool_use_id") for b in kept}
        missing = [c for c in calls if c not in answered]
        others = tuple(b for b in message.blocks if b.get("type") != "tool_result")
        blocks = (*_results(missing), *kept, *others)
        # Only the first user message after the calls may answer them.
        calls = []
        if blocks or message.media:
            out.append(replace(message, blocks=blocks))
    if calls:
        out.append(_not_run(calls, out[-1].turn_id if out else ""))
    return out


def _results(call_ids: list[str]) -> tuple[dict[str, Any], ...]:
    return tuple(
        {"type": "tool_result", "tool_use_id": call_id, "output": None, "error": NOT_RUN}
        for call_id in call_ids
    )


def _not_run(call_ids: list[str], turn_id: str) -> ChatMessage:
    return ChatMessage(role="user", blocks=_results(call_ids), turn_id=turn_id)
