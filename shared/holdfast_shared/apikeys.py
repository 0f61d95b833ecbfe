"""API keys: created, stored as hashes, checked, listed and revoked.

Keys are 256-bit random tokens stored as SHA-256 hashes, each for one tenant.
This module is what ``holdfast keys create`` / ``list`` / ``revoke``, the
``holdfast`` start-up's first key and the gateway's key check share. Nothing
here returns a stored key or its hash: a listing names a key by its id, label
and the first characters it was created with.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.db.models import ApiKey, Tenant

KEY_PREFIX = "hf_"
DEFAULT_TENANT = "default"

# A key's last use is written at most this often: the column answers "is this
# key still in use?", which a minute's precision answers as well as a write
# per request would.
LAST_USED_PRECISION = timedelta(seconds=60)


def hash_key(key: str) -> str:
    # A fast hash is right here: the keys are long random secrets, not
    # passwords, so there is nothing for a slow KDF to protect against.
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


async def ensure_tenant(session: AsyncSession, tenant_id: str, name: str | None = None) -> None:
    if await session.get(Tenant, tenant_id) is None:
        session.add(Tenant(id=tenant_id, name=name or tenant_id))
        await session.flush()


async def add_key(
    session: AsyncSession, tenant_id: str, key: str, *, name: str = "default"
) -> None:
    """Store ``key`` (hashed) for the tenant; adding a known key again is a no-op."""
    await ensure_tenant(session, tenant_id)
    digest = hash_key(key)
    if await session.scalar(select(ApiKey.id).where(ApiKey.key_hash == digest)) is None:
        session.add(
            ApiKey(tenant_id=tenant_id, key_hash=digest, display_prefix=key[:10], name=name)
        )
        await session.flush()


async def has_any_key(session: AsyncSession) -> bool:
    return await session.scalar(select(ApiKey.id).limit(1)) is not None


@dataclass(frozen=True)
class KeyIdentity:
    """Who a valid key speaks for: the key's id and its tenant."""

    key_id: int
    tenant: str


@dataclass(frozen=True)
class KeyInfo:
    """One row of ``holdfast keys list``."""

    id: int
    tenant: str
    label: str
    prefix: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


async def identify_key(session: AsyncSession, key: str) -> KeyIdentity | None:
    """The id and tenant of ``key``, or None for an unknown or revoked key.

    Records the use when the last one recorded is older than
    :data:`LAST_USED_PRECISION` (one conditional UPDATE; the caller commits).
    """
    row = (
        await session.execute(
            select(ApiKey.id, ApiKey.tenant_id, ApiKey.last_used_at).where(
                ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)
            )
        )
    ).one_or_none()
    if row is None:
        return None
    key_id, tenant, last_used = row
    now = datetime.now(UTC)
    if last_used is None or now - last_used >= LAST_USED_PRECISION:
        # The WHERE repeats the test so that gateways checking the same key at
        # the same moment write it once between them.
        await session.execute(
            update(ApiKey)
            .where(
                ApiKey.id == key_id,
                or_(
                    ApiKey.last_used_at.is_(None),
                    ApiKey.last_used_at <= func.now() - LAST_USED_PRECISION,
                ),
            )
            .values(last_used_at=func.now())
        )
    return KeyIdentity(key_id=key_id, tenant=tenant)


async def key_is_active(session: AsyncSession, key_id: int) -> bool:
    """Whether the key ``key_id`` exists and is not revoked."""
    found = await session.scalar(
        select(ApiKey.id).where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
    )
    return found is not None


async def list_keys(session: AsyncSession, *, tenant: str | None = None) -> list[KeyInfo]:
    """Every key (of ``tenant`` when given), oldest first, revoked ones included."""
    query = select(ApiKey).order_by(ApiKey.id)
    if tenant is not None:
        query = query.where(ApiKey.tenant_id == tenant)
    return [
        KeyInfo(
            id=row.id,
            tenant=row.tenant_id,
            label=row.name,
            prefix=row.display_prefix,
            created_at=row.created_at,
            last_used_at=row.last_used_at,
            revoked_at=row.revoked_at,
        )
        for row in await session.scalars(query)
    ]


async def revoke_key(session: AsyncSession, key_id: int) -> datetime | None:
    """Revoke the key ``key_id``; when it was revoked (now, or earlier if it
    already was), or None when there is no such key."""
    revoked: datetime | None = await session.scalar(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=func.now())
        .returning(ApiKey.revoked_at)
    )
    if revoked is not None:
        return revoked
    return await session.scalar(select(ApiKey.revoked_at).where(ApiKey.id == key_id))
