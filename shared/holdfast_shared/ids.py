"""Identifier formats: what a client may send, and how the engine mints ids."""

from __future__ import annotations

import re
import secrets
import time

# Ids appear unescaped inside event JSON and Redis key names, so they are
# limited to characters that need no escaping in either.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
_ID_RE = re.compile(ID_PATTERN)


def is_valid_id(value: str) -> bool:
    return bool(_ID_RE.match(value))


def new_id(prefix: str) -> str:
    """A sortable, unguessable id such as ``task_01J...``: time prefix + randomness."""
    millis = int(time.time() * 1000)
    return f"{prefix}_{millis:012x}{secrets.token_hex(8)}"


def new_task_id() -> str:
    """The engine's own id for a new task (``Task.id``), never reused.

    Distinct from the client's name for the task, which is only unique within
    a tenant and may be taken again after a delete.
    """
    return new_id("tk")


def created_ms(value: str) -> int | None:
    """When an id made by :func:`new_id` was minted (epoch ms), else None."""
    _, _, rest = value.partition("_")
    try:
        return int(rest[:12], 16) if len(rest) >= 12 else None
    except ValueError:
        return None
