"""API-key authentication (``X-Engine-Key``), with a short in-process cache.

The cache keeps the hot path (every ``/execute``) off PostgreSQL; a revoked
key stops working within ``_TTL`` seconds.
"""

from __future__ import annotations

import time

from holdfast_shared.tenancy import tenant_for_key
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

_TTL = 30.0
_MAX_ENTRIES = 10_000


class KeyAuthenticator:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions
        self._cache: dict[str, tuple[str | None, float]] = {}

    async def tenant(self, key: str) -> str | None:
        """The tenant owning ``key``, or None if the key is unknown or revoked."""
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[1] > now:
            return hit[0]
        async with self.sessions() as session:
            tenant = await tenant_for_key(session, key)
        if len(self._cache) >= _MAX_ENTRIES:
            self._cache.clear()
        # Unknown keys are cached briefly only, so a key created a moment ago works.
        self._cache[key] = (tenant, now + (_TTL if tenant else 2.0))
        return tenant
