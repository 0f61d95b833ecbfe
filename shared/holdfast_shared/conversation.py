"""The stored conversation of a task: what the next turn's model call sees.

A message's ``content`` is ``{"blocks": [...]}`` with provider-neutral blocks:
``{"type": "text", "text"}``, ``{"type": "thinking", "text", "signature"?}``,
``{"type": "tool_use", "id", "name", "input"}``, ``{"type": "tool_result",
"tool_use_id", "output", "error"?}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.branches import ON_CURRENT_BRANCH
from holdfast_shared.db.models import Message, Turn
from holdfast_shared.turnqueue import PENDING


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # "user" | "assistant"
    blocks: tuple[dict[str, Any], ...]
    turn_id: str = ""
    media: tuple[dict[str, Any], ...] = field(default=())
    # The provider that produced an assistant message: signatures and
    # thinking are only meaningful to (and accepted by) that provider.
    provider: str | None = None
    # The ``messages`` row it was loaded from (0: not stored, e.g. in tests).
    id: int = 0
    # Its place in its turn: 0 is the user's message, the model's steps follow.
    position: int = 0

    @property
    def text(self) -> str:
        return "".join(b.get("text", "") for b in self.blocks if b.get("type") == "text")


def user_content(text: str, media: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    content: dict[str, Any] = {"blocks": [{"type": "text", "text": text}]}
    if media:
        content["media"] = media
    return content


async def load_history(
    session: AsyncSession, task_id: str, *, cutoff: tuple[str, int] | None = None
) -> list[ChatMessage]:
    """Every message of the task on its current branch, oldest first (messages
    an edit, retry or rollback took off the branch are left out: ``branches``).

    ``cutoff=(turn_id, position)`` leaves out that turn's messages from
    ``position`` on: what a step cut off by a crash had stored already.
    """
    query = select(
        Message.id, Message.role, Message.content, Message.turn_id, Message.position
    ).where(Message.task_id == task_id, ON_CURRENT_BRANCH)
    # A message still waiting for the task (on_busy, ``turnqueue``) is not part of it yet.
    waiting = select(Turn.id).where(Turn.task_id == task_id, Turn.status.in_(PENDING))
    query = query.where(Message.turn_id.not_in(waiting))
    if cutoff is not None:
        query = query.where(or_(Message.turn_id != cutoff[0], Message.position < cutoff[1]))
    rows = (await session.execute(query.order_by(Message.id))).all()
    return [
        ChatMessage(
            role=role,
            blocks=tuple(content.get("blocks", ())),
            turn_id=turn_id,
            media=tuple(content.get("media", ())),
            provider=content.get("provider"),
            id=message_id,
            position=position,
        )
        for message_id, role, content, turn_id, position in rows
    ]


def for_provider(messages: list[ChatMessage], provider: str) -> list[ChatMessage]:
    """The history as ``provider`` may see it.

    Thinking blocks and signatures from another provider are dropped: they
    are opaque to it, and providers reject signatures they did not issue.
    """
    out: list[ChatMessage] = []
    for message in messages:
        if message.role != "assistant" or message.provider in (None, provider):
            out.append(message)
            continue
        blocks = tuple(
            {k: v for k, v in block.items() if k != "signature"}
            for block in message.blocks
            if block.get("type") != "thinking"
        )
        out.append(replace(message, blocks=blocks, provider=provider))
    return out
