"""One exception type for everything the engine (or the way to it) refuses."""

from __future__ import annotations

import json
from typing import Any

import httpx

# Codes of failures the client itself detects (no JSON error body to read).
CONNECTION_LOST = "CONNECTION_LOST"
BAD_RESPONSE = "BAD_RESPONSE"


class HoldfastError(Exception):
    """An error answer of the engine, or a connection the client gave up on.

    ``status`` is the HTTP status (None when no answer came), ``code`` the
    machine-readable code of the JSON error body (``TASK_NOT_FOUND``,
    ``TURN_IN_PROGRESS``, ``INVALID_REQUEST``, ...; ``CONNECTION_LOST`` when
    the client stopped reconnecting), ``message`` the human one, ``details``
    what the body added (``details["errors"]`` names each invalid field).
    """

    def __init__(
        self,
        status: int | None,
        code: str,
        message: str,
        details: dict[str, Any] | None = None,
        *,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}" if status is None else f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details: dict[str, Any] = details or {}
        self.retry_after = retry_after

    @classmethod
    def from_response(cls, response: httpx.Response, body: bytes) -> HoldfastError:
        """The error a non-2xx response stands for (``body`` read already)."""
        code, message, details = f"HTTP_{response.status_code}", "", None
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
            code = parsed["error"]
            message = str(parsed.get("message", ""))
            if isinstance(parsed.get("details"), dict):
                details = parsed["details"]
        else:
            # Not the engine's answer (a proxy's page, say): keep a bounded excerpt.
            message = body[:500].decode("utf-8", "replace") or response.reason_phrase
        return cls(
            response.status_code,
            code,
            message,
            details,
            retry_after=_seconds(response.headers.get("Retry-After")),
        )


def _seconds(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None
