"""Stream tokens: what a browser's ``EventSource`` sends instead of the API key.

``EventSource`` cannot set headers, and an API key must never sit in a URL
(proxies and browser histories keep URLs). So a client holding the key asks
``POST /auth/stream-token`` for a token that opens one task's replay for a
few minutes (``HOLDFAST_STREAM_TOKEN_TTL_SECONDS``) and passes it as
``GET /execute/replay?token=``; the browser's automatic reconnects reuse that
URL and add ``Last-Event-ID`` by themselves.

A token is ``e1.<nonce>.<sealed>`` (base64url): its payload names the tenant,
the task (its engine id and its name), the key that asked for it and the
expiry, sealed with AES-256-GCM, so it is opaque to whoever holds or logs the
URL (it once was readable JSON: the tenant, the internal task id and the key
id for anyone to read) and cannot be changed without the key. The key is
derived from ``HOLDFAST_STREAM_TOKEN_SECRET``, or from a secret derived from
the first ``HOLDFAST_ASSET_ENCRYPTION_KEY`` (which every gateway of a
deployment already shares, so any gateway accepts any other's tokens, with
nothing new to keep). Nothing is stored: a token stops working at its expiry, when the key that
asked for it is revoked (within the auth cache's TTL), or when its task is
deleted (a new task of the same name has another id).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from holdfast_shared.errors import ErrorCode
from holdfast_shared.settings import Settings

from holdfast_gateway.errors import ApiError

T = TypeVar("T")

# "e": encrypted; v1 tokens (signed, readable) are no longer accepted.
_VERSION = "e1"
# Domain separation: the asset key's other use (Fernet) never sees this MAC.
_DERIVATION_LABEL = b"holdfast stream-token secret v1"
_SEALING_LABEL = b"holdfast stream-token sealing e1"
_NONCE_BYTES = 12
# A token is a few hundred bytes; anything much longer is not one of ours.
MAX_TOKEN_CHARS = 2048


@dataclass(frozen=True)
class StreamGrant:
    """What a valid token grants: replaying ``task_name`` (engine id ``task_id``)
    of ``tenant``, as long as the key ``key_id`` is not revoked."""

    tenant: str
    task_id: str
    task_name: str
    key_id: int
    expires_at: int  # epoch seconds


def secret_from_settings(settings: Settings) -> bytes:
    """The HMAC secret: HOLDFAST_STREAM_TOKEN_SECRET, else one derived from the
    first asset encryption key. Raises RuntimeError when neither is set."""
    if settings.stream_token_secret is not None:
        return settings.stream_token_secret.get_secret_value().encode()
    if settings.asset_encryption_key is None:
        raise RuntimeError(
            "set HOLDFAST_STREAM_TOKEN_SECRET or HOLDFAST_ASSET_ENCRYPTION_KEY: "
            "stream tokens are signed with one of them"
        )
    first = settings.asset_encryption_key.get_secret_value().split(",")[0].strip()
    return hmac.new(first.encode(), _DERIVATION_LABEL, hashlib.sha256).digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _invalid(reason: str) -> ApiError:
    return ApiError(401, ErrorCode.STREAM_TOKEN_INVALID, f"the stream token is not valid: {reason}")


class StreamTokens:
    """Issues and checks stream tokens with one secret; ``clock`` is epoch seconds."""

    def __init__(
        self, secret: bytes, ttl_seconds: int, clock: Callable[[], float] = time.time
    ) -> None:
        self._aead = AESGCM(hmac.new(secret, _SEALING_LABEL, hashlib.sha256).digest())
        self.ttl = ttl_seconds
        self.clock = clock

    def issue(self, tenant: str, task_id: str, task_name: str, key_id: int) -> StreamGrant:
        """A grant for the task, expiring ``ttl`` seconds from now."""
        return StreamGrant(tenant, task_id, task_name, key_id, int(self.clock()) + self.ttl)

    def encode(self, grant: StreamGrant) -> str:
        payload = {
            "tn": grant.tenant,
            "ti": grant.task_id,
            "nm": grant.task_name,
            "k": grant.key_id,
            "exp": grant.expires_at,
        }
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(
            nonce, json.dumps(payload, separators=(",", ":")).encode(), _VERSION.encode()
        )
        return f"{_VERSION}.{_b64(nonce)}.{_b64(sealed)}"

    def decode(self, token: str) -> StreamGrant:
        """The grant ``token`` carries; :class:`ApiError` 401 ``STREAM_TOKEN_INVALID``
        when it is malformed or not sealed with this secret, 401
        ``STREAM_TOKEN_EXPIRED`` when it has expired."""
        if len(token) > MAX_TOKEN_CHARS:
            raise _invalid("too long")
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _VERSION:
            raise _invalid(f"not an {_VERSION} token")
        try:
            nonce, sealed = _unb64(parts[1]), _unb64(parts[2])
            # Authenticated before the payload is parsed: nothing forged is interpreted.
            opened = self._aead.decrypt(nonce, sealed, _VERSION.encode())
        except (binascii.Error, ValueError, InvalidTag):
            raise _invalid("not sealed with this gateway's secret") from None
        try:
            payload: Any = json.loads(opened)
            grant = StreamGrant(
                tenant=_typed(payload["tn"], str),
                task_id=_typed(payload["ti"], str),
                task_name=_typed(payload["nm"], str),
                key_id=_typed(payload["k"], int),
                expires_at=_typed(payload["exp"], int),
            )
        except (binascii.Error, ValueError, KeyError, TypeError):
            # Sealed by us yet unreadable: a secret shared with something else.
            raise _invalid("unreadable payload") from None
        if grant.expires_at <= self.clock():
            raise ApiError(
                401,
                ErrorCode.STREAM_TOKEN_EXPIRED,
                "the stream token has expired; ask POST /auth/stream-token for a new one",
                {"expired_at": grant.expires_at * 1000},
            )
        return grant


def _typed(value: object, kind: type[T]) -> T:
    # bool is an int to isinstance; no field of ours is one.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(f"expected {kind.__name__}")
    return value
