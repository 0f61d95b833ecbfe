"""Media items on their way into a request: checked first, then read.

Every provider calls :func:`require_supported` before it renders a request:
an item its model cannot take (the table is ``holdfast_shared.media_support``) fails
the call as ``UNSUPPORTED_MEDIA`` naming the type, before anything is sent.
The gateway refused such items in the new message already; this catches an
older message's item sent to another model since.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any

from holdfast_shared.errors import ErrorCode
from holdfast_shared.media_support import is_linked, unsupported_media
from holdfast_shared.providers.base import ModelRequest, ProviderError

__all__ = ["data_uri", "decoded", "decoded_text", "is_linked", "media_type", "require_supported"]


def require_supported(provider: str, request: ModelRequest) -> None:
    """Raise ``UNSUPPORTED_MEDIA`` when the request holds media ``provider`` cannot take."""
    items = [item for message in request.messages for item in message.media]
    if not items:
        return
    reason = unsupported_media(provider, request.model, items)
    if reason is not None:
        raise ProviderError(
            ErrorCode.UNSUPPORTED_MEDIA,
            reason,
            details={"provider": provider, "model": request.model},
        )


def media_type(item: Mapping[str, Any]) -> str:
    return str(item["media_type"]).lower()


def data_uri(item: Mapping[str, Any]) -> str:
    """An inline item as a ``data:`` URI (what OpenAI takes for images and files)."""
    return f"data:{media_type(item)};base64,{item['data']}"


def decoded(item: Mapping[str, Any]) -> bytes:
    """An inline item's bytes; ``UNSUPPORTED_MEDIA`` when its data is not base64."""
    try:
        return base64.b64decode(str(item["data"]), validate=True)
    except binascii.Error as exc:
        raise ProviderError(
            ErrorCode.UNSUPPORTED_MEDIA, f"a {media_type(item)} item is not valid base64: {exc}"
        ) from exc


def decoded_text(item: Mapping[str, Any]) -> str:
    """An inline ``text/plain`` item's text (UTF-8, undecodable bytes replaced)."""
    return decoded(item).decode("utf-8", errors="replace")
