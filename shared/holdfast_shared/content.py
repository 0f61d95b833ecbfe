"""What a client may send as content: text, media items and answer blocks.

Every string a client sends ends up in PostgreSQL, which refuses NUL
(``\\u0000``) in text and JSONB: such input is refused up front, naming the
field (:data:`Text`), rather than failing at the insert. Media are bounded
per item and in total, so one request cannot grow the gateway, the database
or a Redis job without limit; the gateway also caps whole request bodies
(``HOLDFAST_MAX_BODY_BYTES``).

A media item is stored as given (``model_dump(exclude_none=True)``) in the
user message's ``content["media"]`` (see ``conversation.user_content``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

# The JSON Schema form of "no NUL", so generated clients and fuzzers know it too.
NO_NUL_PATTERN = r"^[^\x00]*$"

MAX_MEDIA_ITEMS = 16
# Base64 characters of one item's ``data`` (3 MiB decoded) and of all items together.
MAX_MEDIA_ITEM_CHARS = 4 * 1024 * 1024
MAX_MEDIA_TOTAL_CHARS = 6 * 1024 * 1024
MAX_URL_CHARS = 2048

_BASE64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
# RFC 6838 type/subtype, without parameters.
_MEDIA_TYPE_PATTERN = (
    r"^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}$"
)
# Printable ASCII (percent-encode the rest): one meaning in every regex dialect,
# where \s is not (Python, Rust and ECMA disagree on U+0085 and U+001C).
_URL_PATTERN = r"^https?://[!-~]+$"


def _refuse_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL (\\u0000) characters")
    # JSON may escape half a surrogate pair ("\\ud800"), which no UTF-8 (so
    # no PostgreSQL text) can hold.
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ValueError("must not contain lone surrogates (\\ud800-\\udfff)") from None
    return value


Text = Annotated[
    str, AfterValidator(_refuse_nul), Field(json_schema_extra={"pattern": NO_NUL_PATTERN})
]
"""A string PostgreSQL can store: no NUL, no lone surrogate; either is a 422 naming the field."""


def _storable(value: Any, path: str = "") -> None:
    if isinstance(value, str):
        try:
            _refuse_nul(value)
        except ValueError as exc:
            raise ValueError(f"{path or 'a string'} {exc}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _storable(key, f"the key {path}/{key[:40]!r}" if isinstance(key, str) else path)
            _storable(item, f"{path}/{str(key)[:40]}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _storable(item, f"{path}/{index}")


def _storable_object(value: dict[str, Any]) -> dict[str, Any]:
    try:
        _storable(value)
    except ValueError as exc:
        # Its own type: JSON Schema cannot say "no NUL" of every nested string
        # and key, so a fuzzer may send one; the 422 still names where it is.
        raise PydanticCustomError("unstorable_json", "{reason}", {"reason": str(exc)}) from None
    return value


StorableObject = Annotated[dict[str, Any], AfterValidator(_storable_object)]
"""A client's JSON object for a JSONB column: no NUL or lone surrogate in any key
or string (PostgreSQL would refuse the row), a 422 naming where."""

MediaKind = Literal["image", "audio", "video", "file"]


class _Media(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: MediaKind
    media_type: Annotated[
        str, Field(pattern=_MEDIA_TYPE_PATTERN, description="e.g. image/png, application/pdf")
    ]
    name: Annotated[Text, Field(max_length=255)] | None = None


class InlineMedia(_Media):
    """A media item carried in the request, base64-encoded."""

    data: Annotated[
        str,
        Field(
            min_length=4,
            max_length=MAX_MEDIA_ITEM_CHARS,
            pattern=_BASE64_PATTERN,
            description="the content, standard base64 with padding",
        ),
    ]


class LinkedMedia(_Media):
    """A media item the model fetches from an http(s) URL."""

    url: Annotated[str, Field(max_length=MAX_URL_CHARS, pattern=_URL_PATTERN)]


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["text"]
    text: Annotated[Text, Field(max_length=100_000)]


def _media_tag(value: Any) -> str | None:
    if isinstance(value, BaseModel):
        return "url" if isinstance(value, LinkedMedia) else "data"
    if isinstance(value, dict):
        return "url" if "url" in value and "data" not in value else "data"
    return None


def _block_tag(value: Any) -> str | None:
    if isinstance(value, TextBlock) or (isinstance(value, dict) and value.get("type") == "text"):
        return "text"
    return _media_tag(value)


MediaItem = Annotated[
    Annotated[InlineMedia, Tag("data")] | Annotated[LinkedMedia, Tag("url")],
    Discriminator(_media_tag),
]
"""One media item: inline (``data``) or linked (``url``), never both."""

ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[InlineMedia, Tag("data")]
    | Annotated[LinkedMedia, Tag("url")],
    Discriminator(_block_tag),
]
"""A block attached to a human's answer: text or a media item."""


def check_media_total(items: Iterable[BaseModel]) -> None:
    """Raise ValueError when the inline media of ``items`` exceed the total cap."""
    total = sum(len(item.data) for item in items if isinstance(item, InlineMedia))
    if total > MAX_MEDIA_TOTAL_CHARS:
        raise ValueError(
            f"inline media total {total} base64 characters, more than {MAX_MEDIA_TOTAL_CHARS}"
        )


def as_stored(items: Iterable[BaseModel]) -> list[dict[str, Any]]:
    """Items as plain JSON objects, unset fields left out: how they are stored and queued."""
    return [item.model_dump(exclude_none=True) for item in items]
