"""Whose memory: a tenant's brain, partitioned by end user."""

from __future__ import annotations

import re
from dataclasses import dataclass

# user_id appears in URLs and rows only (never in Redis keys), but is kept to
# the same alphabet as every other id so it needs no escaping anywhere.
USER_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}$"
_USER_ID = re.compile(USER_ID_PATTERN)


@dataclass(frozen=True, slots=True)
class Brain:
    """The long-term memory one turn reads and feeds.

    Every task of a tenant shares its brain; an app with many end users
    passes ``user_id`` on ``/execute`` and each user gets a brain of their
    own inside the tenant ("" is the tenant's own). Brains never see each
    other's memories.
    """

    tenant_id: str
    user_id: str = ""


def is_valid_user_id(value: str) -> bool:
    return bool(_USER_ID.match(value))
