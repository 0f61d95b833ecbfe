"""The stored conversation of a task: what the next turn's model call sees.

A message's ``content`` is ``{"blocks": [...]}`` with provider-neutral blocks:
``{"type": "text", "text"}``, ``{"type": "thinking", "text", "signature"?}``,
``{"type": "tool_use", "id", "name", "input"}``, ``{"type": "tool_result",
"tool_use_id", "output", "error"?}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.db.models import Message


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str  # "user" | "assistant"
    blocks: tuple[dict[str, Any], ...]
    turn_id: str = ""
    media: tuple[dict[str, Any], ...] = field(default=())
    # The provider that produced an assistant message: signatures and
    # thinking are only meaningful to (and accepted by) that provider.
    provider: str | None = None

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
    """Every message of the task, oldest first.

    ``cutoff=(turn_id, position)`` leaves out that turn's messages from
    ``position`` on: what a step cut off by a crash had stored already.
    """
    query = select(Message.role, Message.content, Message.turn_id).where(Message.task_id == task_id)
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
        )
        for role, content, turn_id in rows
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
        out.append(ChatMessage(message.role, blocks, message.turn_id, message.media, provider))
    return out
