"""Tenants and API keys. Keys are 256-bit random tokens stored as SHA-256 hashes."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.db.models import ApiKey, Tenant

KEY_PREFIX = "hf_"
DEFAULT_TENANT = "default"


def hash_key(key: str) -> str:
    # A fast hash is right here: the keys are long random secrets, not
    # passwords, so there is nothing for a slow KDF to protect against.
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


async def tenant_for_key(session: AsyncSession, key: str) -> str | None:
    """The tenant id owning ``key``, or None for an unknown or revoked key."""
    return await session.scalar(
        select(ApiKey.tenant_id).where(
            ApiKey.key_hash == hash_key(key), ApiKey.revoked_at.is_(None)
        )
    )


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
