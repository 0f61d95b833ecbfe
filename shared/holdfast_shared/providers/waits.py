"""How long a server asks to be left alone: its retry headers, read one way for
every provider (``ProviderError.retry_after``, which ``calls.py`` honours).

In order: ``retry-after-ms`` (OpenAI's and Anthropic's own, exact), then
``retry-after`` (seconds, or an HTTP date), then — a 429 that says neither —
the rate-limit headers' reset of the limit that is used up: OpenAI's
``x-ratelimit-remaining-<limit>: 0`` with ``x-ratelimit-reset-<limit>`` (a
duration such as ``6m0s`` or ``120ms``), Anthropic's
``anthropic-ratelimit-<limit>-remaining: 0`` with
``anthropic-ratelimit-<limit>-reset`` (an RFC 3339 time). Several used up:
the latest reset, since the call needs them all.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from datetime import datetime
from email.utils import parsedate_to_datetime

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_OPENAI_RESET = re.compile(r"x-ratelimit-reset-(.+)")
_ANTHROPIC_RESET = re.compile(r"anthropic-ratelimit-(.+)-reset")


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait before the next call, from an error answer's headers; None: no hint."""
    explicit = _explicit(headers)
    return explicit if explicit is not None else _exhausted_reset(headers)


def _explicit(headers: Mapping[str, str]) -> float | None:
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return max(float(millis) / 1000, 0.0)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        return max(parsedate_to_datetime(value).timestamp() - time.time(), 0.0)
    except (TypeError, ValueError):
        return None


def _exhausted_reset(headers: Mapping[str, str]) -> float | None:
    waits: list[float] = []
    for name, value in headers.items():
        name = name.lower()
        if match := _OPENAI_RESET.fullmatch(name):
            remaining = headers.get(f"x-ratelimit-remaining-{match[1]}")
            wait = _duration(value)
        elif match := _ANTHROPIC_RESET.fullmatch(name):
            remaining = headers.get(f"anthropic-ratelimit-{match[1]}-remaining")
            wait = _until(value)
        else:
            continue
        if remaining is not None and remaining.strip() == "0" and wait is not None:
            waits.append(wait)
    return max(waits) if waits else None


def _duration(value: str) -> float | None:
    """``6m0s``, ``1.5s``, ``120ms``, ``1h2m3s`` in seconds."""
    value = value.strip()
    parts = _DURATION_PART.findall(value)
    if not parts or "".join(n + unit for n, unit in parts) != value:
        return None
    return sum(float(n) * _UNIT_SECONDS[unit] for n, unit in parts)


def _until(value: str) -> float | None:
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return max(moment.timestamp() - time.time(), 0.0)
