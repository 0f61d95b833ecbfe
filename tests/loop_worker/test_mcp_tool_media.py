"""An MCP tool's image reaches the model as an image block, not base64 in text
(issue #31, 9): ``context/tool_media.py`` through each provider's rendering."""

from __future__ import annotations

import base64
import json
from typing import Any

from holdfast_loop_worker.context.assembly import Sections, assemble
from holdfast_loop_worker.context.tool_media import with_tool_media
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.providers import anthropic, openai

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64).decode()


def _results(*content: dict[str, Any], error: str | None = None) -> ChatMessage:
    block: dict[str, Any] = {
        "type": "tool_result",
        "tool_use_id": "call-1",
        "output": {"content": list(content)},
    }
    if error is not None:
        block["error"] = error
    return ChatMessage(role="user", blocks=(block,))


def _history() -> list[ChatMessage]:
    call = {"type": "tool_use", "id": "call-1", "name": "srv__get-tiny-image", "input": {}}
    return [
        ChatMessage(role="user", blocks=({"type": "text", "text": "show me"},)),
        ChatMessage(role="assistant", blocks=(call,)),
        _results(
            {"type": "text", "text": "A tiny image:"},
            {"type": "image", "data": PNG, "mimeType": "image/png"},
        ),
    ]


def test_an_image_becomes_the_messages_media_and_the_result_keeps_a_note() -> None:
    lifted = with_tool_media(_history()[2], provider="anthropic", model="claude-sonnet-4-5")
    assert lifted.media == ({"type": "image", "media_type": "image/png", "data": PNG},)
    content = lifted.blocks[0]["output"]["content"]
    assert content[0] == {"type": "text", "text": "A tiny image:"}
    assert content[1]["type"] == "image" and "data" not in content[1]
    assert PNG not in json.dumps(lifted.blocks)


def test_anthropic_gets_an_image_block_beside_the_tool_result() -> None:
    sections = Sections(system_prompt="s", soul="", history=_history())
    built = assemble(sections, model="claude-sonnet-4-5", provider="anthropic")
    messages = anthropic.to_messages(built.request.messages)
    last = messages[-1]["content"]
    assert isinstance(last, list)
    kinds = [block["type"] for block in last]
    assert kinds[:2] == ["tool_result", "image"], kinds
    image = last[1]
    assert image["source"]["data"] == PNG and image["source"]["media_type"] == "image/png"
    assert PNG not in json.dumps(last[0])  # not as text in the result


def test_openai_gets_an_image_part_after_the_tool_message() -> None:
    sections = Sections(system_prompt="s", soul="", history=_history())
    built = assemble(sections, model="gpt-4o", provider="openai")
    messages = openai.to_messages(built.request)
    tool = next(m for m in messages if m["role"] == "tool")
    assert PNG not in json.dumps(tool)
    user = messages[-1]
    assert user["role"] == "user"
    parts = user["content"]
    assert isinstance(parts, list)
    assert parts[0]["type"] == "image_url"
    assert parts[0]["image_url"]["url"] == f"data:image/png;base64,{PNG}"


def test_media_the_model_cannot_take_is_left_out_with_a_note() -> None:
    audio = {"type": "audio", "data": "AAAA", "mimeType": "audio/ogg"}
    lifted = with_tool_media(_results(audio), provider="anthropic", model="claude-sonnet-4-5")
    assert lifted.media == ()
    (kept,) = lifted.blocks[0]["output"]["content"]
    assert "cannot take audio/ogg" in kept["note"] and "data" not in kept


def test_messages_without_tool_media_are_unchanged() -> None:
    plain = _results({"type": "text", "text": "no image"})
    assert with_tool_media(plain, provider="anthropic", model="m") is plain
