"""Images and audio a tool returned, given to the model as media, not as text.

An MCP tool's result holds its content blocks as MCP sends them
(``connectors/outcomes.py`` in the tool-runner): an ``image`` or ``audio``
block carries base64 ``data`` and its ``mimeType``. Left in the tool result,
the model would read that base64 as text (a screenshot alone would fill the
tool result's share of the context). Instead each such block the model can
take becomes a media item of the tool results' message (``ChatMessage.media``,
which every provider renders as its own media blocks: an Anthropic image block
beside the ``tool_result``, an OpenAI image part, a Gemini inline part), and
the result keeps a short note in its place. A block the model cannot take
(``holdfast_shared.media_support``) keeps only the note: the call still
succeeds, the model is told what it could not see.

Done as the request is assembled, for its provider and model: the stored
message and the ``tool_result`` event keep the content as the server sent it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from holdfast_shared.conversation import ChatMessage
from holdfast_shared.media_support import first_unsupported

_KINDS = ("image", "audio")


def with_tool_media(message: ChatMessage, *, provider: str, model: str) -> ChatMessage:
    """``message`` with its tool results' images and audio moved to its media."""
    if message.role != "user" or not any(b.get("type") == "tool_result" for b in message.blocks):
        return message
    lifted: list[dict[str, Any]] = []
    blocks = tuple(
        _lift(block, lifted, provider, model) if block.get("type") == "tool_result" else block
        for block in message.blocks
    )
    if blocks == message.blocks:
        return message
    return replace(message, blocks=blocks, media=(*message.media, *lifted))


def _lift(
    block: dict[str, Any], lifted: list[dict[str, Any]], provider: str, model: str
) -> dict[str, Any]:
    output = block.get("output")
    content = output.get("content") if isinstance(output, dict) else None
    if not isinstance(content, list) or not any(_media_block(b) for b in content):
        return block
    kept: list[Any] = []
    for item in content:
        if not _media_block(item):
            kept.append(item)
            continue
        kind, mime = item["type"], str(item["mimeType"]).lower()
        media = {"type": kind, "media_type": mime, "data": item["data"]}
        if first_unsupported(provider, model, [media]) is None:
            lifted.append(media)
            note = f"attached to this message as media item {len(lifted)}"
        else:
            note = f"left out: {provider}:{model} cannot take {mime}"
        kept.append({"type": kind, "mimeType": mime, "note": note})
    assert isinstance(output, dict)
    return {**block, "output": {**output, "content": kept}}


def _media_block(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and item.get("type") in _KINDS
        and isinstance(item.get("data"), str)
        and isinstance(item.get("mimeType"), str)
    )
