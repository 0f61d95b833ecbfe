"""A tenant's webhook settings: its signing secret (sealed) and its default subscription.

A rotation keeps the secret it replaces for :data:`ROTATION_GRACE`: messages
are signed with both meanwhile (Standard Webhooks lets a signature header
carry several), so a receiver verifies with either while it switches.
"""

from __future__ import annotations

import base64
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

from holdfast_shared.assets import Vault
from holdfast_shared.db.models import WebhookTenant
from sqlalchemy import func, null, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

# Standard Webhooks secrets: "whsec_" and base64 of 24 to 64 random bytes.
_SECRET_BYTES = 32
# How long a rotated-out secret still signs (beside the new one).
ROTATION_GRACE = timedelta(hours=24)


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(_SECRET_BYTES)).decode()


async def rotate_secret(session: AsyncSession, vault: Vault, tenant_id: str) -> str:
    """A new signing secret for the tenant, returned in clear this once; the one
    it replaces keeps signing beside it for :data:`ROTATION_GRACE`."""
    secret = new_secret()
    sealed = vault.seal(secret)
    await session.execute(
        insert(WebhookTenant)
        .values(tenant_id=tenant_id, secret=sealed)
        .on_conflict_do_update(
            index_elements=[WebhookTenant.tenant_id],
            set_={
                # The row's value before this update: the secret being replaced.
                "previous_secret": WebhookTenant.secret,
                "rotated_at": func.now(),
                "secret": sealed,
                "updated_at": func.now(),
            },
        )
    )
    return secret


async def has_secret(session: AsyncSession, tenant_id: str) -> bool:
    found = await session.scalar(
        select(WebhookTenant.secret).where(WebhookTenant.tenant_id == tenant_id)
    )
    return found is not None


async def signing_secrets(
    session: AsyncSession, vault: Vault, tenant_id: str, *, now: datetime | None = None
) -> list[str]:
    """The secrets a message is signed with now, in clear: the tenant's, and the
    one a rotation replaced while its grace lasts (empty: it has none)."""
    row = (
        await session.execute(
            select(
                WebhookTenant.secret, WebhookTenant.previous_secret, WebhookTenant.rotated_at
            ).where(WebhookTenant.tenant_id == tenant_id)
        )
    ).first()
    if row is None or row.secret is None:
        return []
    found = [str(vault.open(row.secret))]
    now = now or datetime.now(UTC)
    if row.previous_secret is not None and row.rotated_at is not None:
        if now - row.rotated_at < ROTATION_GRACE:
            found.append(str(vault.open(row.previous_secret)))
    return found


async def default_webhook(session: AsyncSession, tenant_id: str) -> dict[str, Any] | None:
    return await session.scalar(
        select(WebhookTenant.default_webhook).where(WebhookTenant.tenant_id == tenant_id)
    )


async def set_default_webhook(
    session: AsyncSession, tenant_id: str, webhook: dict[str, Any] | None
) -> None:
    """The subscription of the tenant's turns that name none (None: no default)."""
    # SQL NULL, not JSON null: the outbox's statement falls back on NULL alone.
    value = null() if webhook is None else webhook
    await session.execute(
        insert(WebhookTenant)
        .values(tenant_id=tenant_id, default_webhook=value)
        .on_conflict_do_update(
            index_elements=[WebhookTenant.tenant_id],
            set_={"default_webhook": value, "updated_at": func.now()},
        )
    )
