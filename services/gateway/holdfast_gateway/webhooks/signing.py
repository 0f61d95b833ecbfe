"""Signing a message per the Standard Webhooks spec, with the reference implementation.

``webhook-signature`` is ``v1,<base64 HMAC-SHA256 over "id.timestamp.body">``
under the tenant's secret (one signature per secret, space-separated, while a
rotated-out secret still signs). The timestamp is the attempt's: receivers
refuse messages more than five minutes old, and a retry an hour later must pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from standardwebhooks import Webhook


def signed_headers(
    secrets: Sequence[str], message_id: str, body: str, now: datetime
) -> dict[str, str]:
    """The headers of one attempt to deliver ``body`` as message ``message_id``,
    signed with each of ``secrets``."""
    now = now.astimezone(UTC)
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": " ".join(
            Webhook(secret).sign(message_id, now, body) for secret in secrets
        ),
    }
