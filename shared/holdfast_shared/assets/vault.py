"""Credentials at rest: Fernet (AES-128-CBC + HMAC-SHA256) under ``HOLDFAST_ASSET_ENCRYPTION_KEY``.

What the Asset Directory stores for a server that is secret — a bearer token,
OAuth client secrets and tokens, a stdio server's environment — is sealed here
before it reaches PostgreSQL and opened only where it is used (the tool-runner
calling the server, the gateway completing an authorization). The setting may
hold several keys, comma-separated: the first seals, every one opens, so a key
is rotated by putting the new one first and re-sealing at leisure.

Nothing here logs, and :class:`VaultError` never carries the plaintext or the
key in its message.
"""

from __future__ import annotations

import json
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from holdfast_shared.settings import Settings

KEY_SETTING = "HOLDFAST_ASSET_ENCRYPTION_KEY"


class VaultError(RuntimeError):
    """No usable key, or a sealed value this key cannot open (the message says which)."""


class Vault:
    """Seals JSON values into Fernet tokens (text) and opens them again."""

    def __init__(self, keys: str) -> None:
        parts = [part.strip() for part in keys.split(",") if part.strip()]
        if not parts:
            raise VaultError(f"{KEY_SETTING} is empty")
        try:
            self._fernet = MultiFernet([Fernet(part.encode()) for part in parts])
        except ValueError:
            raise VaultError(
                f"{KEY_SETTING} is not a Fernet key (32 url-safe base64-encoded bytes; "
                'make one with python -c "from cryptography.fernet import Fernet; '
                'print(Fernet.generate_key().decode())")'
            ) from None

    @staticmethod
    def generate_key() -> str:
        """A new random key, as the setting takes it."""
        return Fernet.generate_key().decode()

    def seal(self, value: Any) -> str:
        """``value`` (JSON-serialisable) as a Fernet token."""
        return self._fernet.encrypt(json.dumps(value, separators=(",", ":")).encode()).decode()

    def open(self, token: str) -> Any:
        """The value sealed in ``token``; VaultError if no key opens it."""
        try:
            return json.loads(self._fernet.decrypt(token.encode()))
        except InvalidToken:
            raise VaultError(
                f"stored credentials cannot be decrypted with {KEY_SETTING} "
                "(sealed under another key?)"
            ) from None


def vault_from_settings(settings: Settings) -> Vault:
    """The vault of ``HOLDFAST_ASSET_ENCRYPTION_KEY``; VaultError saying what to set."""
    key = settings.asset_encryption_key
    if key is None or not key.get_secret_value().strip():
        raise VaultError(
            f"{KEY_SETTING} is not set: the Asset Directory encrypts MCP server credentials "
            'with it. Set it to a Fernet key (python -c "from cryptography.fernet import '
            'Fernet; print(Fernet.generate_key().decode())"); `holdfast up` generates one '
            "and keeps it in its data directory"
        )
    return Vault(key.get_secret_value())
