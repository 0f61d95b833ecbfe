"""Media reach each model in its API's own format, or fail before anything is sent.

What a client sends on ``/execute`` (``media``: base64 ``data`` or a
``url``) is stored on the user message and loaded as ``ChatMessage.media``;
here the providers render it through the real SDKs and the wire servers
record what arrived.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest
from holdfast_shared.conversation import ChatMessage
from holdfast_shared.media_support import unsupported_media
from holdfast_shared.providers.base import ModelRequest, ProviderError

from tests.providers.apis import ANTHROPIC, GEMINI, OPENAI, Api, each_api
from tests.providers.streams import SYSTEM, collect, user
from tests.providers.wire import WireServer

pytestmark = pytest.mark.timeout(30)

# A 1x1 PNG; its base64 holds a "+", which URL-safe base64 writes otherwise.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9"
    "awAAAABJRU5ErkJggg=="
)
PDF = base64.b64encode(b"%PDF-1.4\n1 0 obj<</Type/Catalog>>endobj\ntrailer<<>>\n%%EOF\n").decode()
IMAGE_URL = "https://example.org/chart.png"
PDF_URL = "https://example.org/report.pdf"

INLINE_IMAGE = {"type": "image", "media_type": "image/png", "data": PNG, "name": "dot.png"}
LINKED_IMAGE = {"type": "image", "media_type": "image/png", "url": IMAGE_URL}
INLINE_PDF = {"type": "file", "media_type": "application/pdf", "data": PDF, "name": "q3.pdf"}


def with_media(text: str, *media: dict[str, Any]) -> ChatMessage:
    return ChatMessage("user", ({"type": "text", "text": text},), media=media)


async def send(api: Api, wire: WireServer, *messages: ChatMessage, model: str = "") -> Any:
    """The conversation of the one request the server got for ``messages``."""
    provider = api.connect(wire)
    wire.queue(api.text("ok"))
    try:
        request = ModelRequest(model=model or api.model, system=SYSTEM, messages=messages)
        await collect(provider.stream(request))
    finally:
        await provider.aclose()
    [sent] = wire.requests
    return sent.json[api.conversation]


async def test_anthropic_takes_image_and_document_blocks(wire: WireServer) -> None:
    text_item = {
        "type": "file",
        "media_type": "text/plain",
        "data": base64.b64encode("Totals: 42 €".encode()).decode(),
        "name": "notes.txt",
    }
    linked_pdf = {"type": "file", "media_type": "application/pdf", "url": PDF_URL}
    history = (
        with_media("Read these.", linked_pdf, text_item),
        ChatMessage("assistant", ({"type": "text", "text": "Read."},), provider="anthropic"),
        with_media("What do these show?", INLINE_IMAGE, LINKED_IMAGE, INLINE_PDF),
    )

    earlier, _, newest = await send(ANTHROPIC, wire, *history)

    assert earlier["content"][:2] == [
        {"type": "document", "source": {"type": "url", "url": PDF_URL}},
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "Totals: 42 €"},
            "title": "notes.txt",
        },
    ]
    assert newest["content"][:3] == [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": IMAGE_URL}},
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
            "title": "q3.pdf",
        },
    ]
    # The media come before the text they are asked about.
    assert newest["content"][3]["text"] == "What do these show?"


async def test_openai_takes_image_url_and_file_parts(wire: WireServer) -> None:
    message = with_media("What do these show?", INLINE_IMAGE, LINKED_IMAGE, INLINE_PDF)

    messages = await send(OPENAI, wire, message)

    assert messages[1] == {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            {"type": "image_url", "image_url": {"url": IMAGE_URL}},
            {
                "type": "file",
                "file": {"filename": "q3.pdf", "file_data": f"data:application/pdf;base64,{PDF}"},
            },
            {"type": "text", "text": "What do these show?"},
        ],
    }


async def test_openai_audio_goes_to_audio_models_as_input_audio(wire: WireServer) -> None:
    wav = base64.b64encode(b"RIFF\x24\x00\x00\x00WAVEfmt ").decode()
    clip = {"type": "audio", "media_type": "audio/wav", "data": wav}

    messages = await send(
        OPENAI, wire, with_media("Transcribe.", clip), model="gpt-4o-audio-preview"
    )

    assert messages[1]["content"][0] == {
        "type": "input_audio",
        "input_audio": {"data": wav, "format": "wav"},
    }


async def test_gemini_takes_inline_data_and_file_data(wire: WireServer) -> None:
    message = with_media("What do these show?", INLINE_IMAGE, LINKED_IMAGE, INLINE_PDF)

    [sent] = await send(GEMINI, wire, message)

    # The SDK's own encoding of bytes: URL-safe base64 (the API takes either alphabet).
    def wire_b64(data: str) -> str:
        return base64.urlsafe_b64encode(base64.b64decode(data)).decode()

    assert sent["parts"] == [
        {"inlineData": {"mimeType": "image/png", "data": wire_b64(PNG)}},
        {"fileData": {"mimeType": "image/png", "fileUri": IMAGE_URL}},
        {"inlineData": {"mimeType": "application/pdf", "data": wire_b64(PDF)}},
        {"text": "What do these show?"},
    ]


@each_api
async def test_media_of_earlier_messages_are_sent_again(wire: WireServer, api: Api) -> None:
    history = (
        with_media("Look at this.", LINKED_IMAGE),
        ChatMessage("assistant", ({"type": "text", "text": "A bar chart."},), provider=api.name),
        user("What is its title?"),
    )

    conversation = await send(api, wire, *history)

    first_user = next(m for m in conversation if m.get("role") == "user")
    assert IMAGE_URL in str(first_user)
    assert IMAGE_URL not in str(conversation[-1])


@pytest.mark.parametrize(
    ("api", "item", "model"),
    [
        (ANTHROPIC, {"type": "audio", "media_type": "audio/wav", "data": PNG}, ""),
        (ANTHROPIC, {"type": "file", "media_type": "text/plain", "url": "https://x.org/a"}, ""),
        (OPENAI, {"type": "file", "media_type": "application/pdf", "url": PDF_URL}, ""),
        (OPENAI, {"type": "audio", "media_type": "audio/wav", "data": PNG}, "gpt-4.1"),
        (OPENAI, INLINE_IMAGE, "o3-mini"),
        (GEMINI, {"type": "image", "media_type": "image/gif", "data": PNG}, ""),
    ],
    ids=[
        "anthropic-audio",
        "anthropic-text-url",
        "openai-pdf-url",
        "openai-audio",
        "openai-o3-mini",
        "gemini-gif",
    ],
)
async def test_a_type_the_model_cannot_take_fails_before_anything_is_sent(
    wire: WireServer, api: Api, item: dict[str, Any], model: str
) -> None:
    provider = api.connect(wire)
    request = ModelRequest(
        model=model or api.model, system=SYSTEM, messages=(with_media("See.", item),)
    )

    with pytest.raises(ProviderError) as caught:
        await collect(provider.stream(request))
    await provider.aclose()

    assert caught.value.code == "UNSUPPORTED_MEDIA"
    assert item["media_type"] in caught.value.message
    assert not caught.value.retryable
    assert wire.requests == []
    assert unsupported_media(api.name, request.model, [item]) == caught.value.message


def test_scripted_takes_anything() -> None:
    assert unsupported_media("scripted", "scripted", [{"media_type": "video/x-nothing"}]) is None
