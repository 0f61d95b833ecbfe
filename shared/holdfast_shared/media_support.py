"""Which media each model provider takes, and how: the one table.

A media item is what ``/execute`` stored (``content.InlineMedia`` /
``LinkedMedia`` dumped): ``{"type", "media_type", "name"?, "data" | "url"}``.
Every provider renders an item by its ``media_type`` in the API's own form
(Anthropic image/document blocks, OpenAI ``image_url``/``file``/
``input_audio`` parts, Gemini ``inlineData``/``fileData``); the ``type`` is
the client's hint and decides nothing.

Two readers, one answer: the gateway refuses with a 422 (``UNSUPPORTED_MEDIA``)
a message whose media the turn's model cannot take, before the turn starts;
each provider checks the whole request again before it renders it (an older
message's media may have been sent to another model), so such an item fails
as ``UNSUPPORTED_MEDIA`` naming the type, never as the API's own 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

IMAGES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
PDF = "application/pdf"
PLAIN_TEXT = "text/plain"

# Chat Completions' input_audio takes these two formats.
OPENAI_AUDIO_FORMATS: dict[str, Literal["wav", "mp3"]] = {
    "audio/wav": "wav",
    "audio/x-wav": "wav",
    "audio/wave": "wav",
    "audio/mpeg": "mp3",
    "audio/mp3": "mp3",
}

# Gemini's documented types (no GIF), as inline data or fetched by URL.
_GEMINI = frozenset(
    {
        *("image/png", "image/jpeg", "image/webp", "image/heic", "image/heif"),
        *("audio/wav", "audio/mp3", "audio/mpeg", "audio/aiff", "audio/aac"),
        *("audio/ogg", "audio/flac"),
        *("video/mp4", "video/mpeg", "video/mov", "video/quicktime", "video/avi"),
        *("video/x-flv", "video/mpg", "video/webm", "video/wmv", "video/3gpp"),
        PDF,
        PLAIN_TEXT,
    }
)


@dataclass(frozen=True, slots=True)
class Accepted:
    """The media types a model takes inline (base64 ``data``) and by ``url``."""

    inline: frozenset[str]
    linked: frozenset[str]

    def takes(self, item: Mapping[str, Any]) -> bool:
        types = self.linked if is_linked(item) else self.inline
        return str(item.get("media_type", "")).lower() in types


_TABLE = {
    # Images as base64 or URL sources; PDFs as document blocks (base64 or
    # URL); plain text as a document block with a text source (inline only).
    "anthropic": Accepted(inline=IMAGES | {PDF, PLAIN_TEXT}, linked=IMAGES | {PDF}),
    # image_url parts take a URL or a data: URI; file parts take PDFs as
    # base64 only (Chat Completions fetches no file URL); input_audio takes
    # base64 wav/mp3, on audio models only (see accepted()).
    "openai": Accepted(inline=IMAGES | {PDF} | frozenset(OPENAI_AUDIO_FORMATS), linked=IMAGES),
    # inlineData for base64; fileData with the URL, which Gemini fetches
    # (public or signed http(s) URLs).
    "gemini": Accepted(inline=_GEMINI, linked=_GEMINI),
}
# Chat Completions models without image (or any media) input.
_OPENAI_TEXT_ONLY = ("gpt-3.5", "o1-mini", "o3-mini")


def accepted(provider: str, model: str) -> Accepted | None:
    """What ``provider:model`` takes; None: anything (``scripted`` renders no media)."""
    table = _TABLE.get(provider)
    if table is None:
        return None
    if provider == "openai":
        name = model.lower()
        if name.startswith(_OPENAI_TEXT_ONLY):
            return Accepted(frozenset(), frozenset())
        if "audio" not in name:
            # input_audio is refused by every Chat Completions model but the audio ones.
            return Accepted(table.inline - frozenset(OPENAI_AUDIO_FORMATS), table.linked)
    return table


def unsupported_media(provider: str, model: str, items: Sequence[Mapping[str, Any]]) -> str | None:
    """None when ``provider:model`` takes every item, else why not, naming the type."""
    table = accepted(provider, model)
    index = first_unsupported(provider, model, items)
    if table is None or index is None:
        return None
    item = items[index]
    how = "by URL" if is_linked(item) else "as base64 data"
    types = sorted(table.linked if is_linked(item) else table.inline)
    takes = f"it takes {', '.join(types)}" if types else "it takes none"
    return f"{provider}:{model} cannot take {item.get('media_type')} media {how} ({takes})"


def first_unsupported(provider: str, model: str, items: Sequence[Mapping[str, Any]]) -> int | None:
    """The index of the first item ``provider:model`` cannot take, or None."""
    table = accepted(provider, model)
    if table is None:
        return None
    return next((i for i, item in enumerate(items) if not table.takes(item)), None)


def is_linked(item: Mapping[str, Any]) -> bool:
    """The item points at a URL rather than carrying its data."""
    return "url" in item and "data" not in item
