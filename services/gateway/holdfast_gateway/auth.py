"""API-key authentication (``X-Engine-Key``): bounded caches and a failure limit.

Known keys are kept in an LRU cache, which keeps the hot path (every
``/execute``) off PostgreSQL; a revoked key stops working within
``ttl_seconds`` (``HOLDFAST_AUTH_CACHE_TTL_SECONDS``, 30 s by default), and so
do the stream tokens it was issued (:meth:`KeyAuthenticator.key_active`). A
look-up also records the key's last use, at most once a minute
(:func:`holdfast_shared.apikeys.identify_key`). Unknown keys are kept apart,
briefly (a key created a moment ago soon works) and in a smaller LRU, so a
flood of random keys can neither evict the known ones nor make each repeat a
database look-up.

Each client address may fail a number of key checks per window (a token
bucket: ``failures_allowed`` tokens, refilled evenly over ``window_seconds``);
past that its bad keys get :class:`RateLimited` (429 with Retry-After) instead
of 401. Only failures count: a valid key is never refused by the limit, even
one this gateway has not seen yet and from an address locked out (a client
behind the same NAT as a guesser, or the guesser's own good key). A token is
taken before the look-up and given back when the key turns out valid, so
concurrent guesses cannot outrun the limit; the look-ups of a locked-out
address run at most :data:`_LOCKED_OUT_LOOKUPS` at a time across all addresses,
so a flood of guesses costs PostgreSQL that many connections, not its pool.
The address is the connection's, or what ``X-Forwarded-For`` says when the
connection comes from one of ``HOLDFAST_TRUSTED_PROXIES`` (uvicorn's proxy
headers, set up in ``main.py``); behind a proxy not listed there every client
shares the proxy's address.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from holdfast_shared.apikeys import KeyIdentity, hash_key, identify_key, key_is_active
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

_TTL = 30.0
_MISS_TTL = 2.0
_MAX_KNOWN = 10_000
_MAX_UNKNOWN = 4_096
_MAX_ADDRESSES = 10_000
# Key look-ups on behalf of locked-out addresses, at once: enough that a valid key
# among a flood of guesses waits little, few enough to leave the pool to others.
_LOCKED_OUT_LOOKUPS = 2

V = TypeVar("V")


class RateLimited(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"too many failed key checks; retry after {retry_after} s")
        self.retry_after = retry_after


class _Lru(Generic[V]):
    """A dict bounded to ``size`` entries; the least recently used one goes first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, V] = OrderedDict()

    def get(self, key: str) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: str, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def pop(self, key: str) -> None:
        self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


class FailureLimiter:
    """Failed key checks per client address, as one token bucket each."""

    def __init__(
        self, allowed: int, window_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.allowed = allowed
        self.rate = allowed / window_seconds
        self.clock = clock
        # address -> (tokens, when counted); an absent address has a full bucket.
        self._buckets: _Lru[tuple[float, float]] = _Lru(_MAX_ADDRESSES)

    def _tokens(self, address: str) -> float:
        now = self.clock()
        tokens, then = self._buckets.get(address) or (float(self.allowed), now)
        return min(float(self.allowed), tokens + (now - then) * self.rate)

    def retry_after(self, address: str) -> int:
        """Seconds until ``address`` may fail again; 0 when it may now."""
        tokens = self._tokens(address)
        return 0 if tokens >= 1 else max(1, math.ceil((1 - tokens) / self.rate))

    def take(self, address: str) -> None:
        self._buckets.put(address, (self._tokens(address) - 1, self.clock()))

    def give_back(self, address: str) -> None:
        self._buckets.put(
            address, (min(float(self.allowed), self._tokens(address) + 1), self.clock())
        )


class KeyAuthenticator:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        *,
        failures_allowed: int = 30,
        failure_window_seconds: float = 60.0,
        ttl_seconds: float = _TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sessions = sessions
        self.clock = clock
        self.ttl = ttl_seconds
        # Keyed by the key's hash: the plain keys are not kept in memory.
        self._known: _Lru[tuple[KeyIdentity, float]] = _Lru(_MAX_KNOWN)
        # Key id -> (still active, until when that holds), for stream tokens.
        self._active: _Lru[tuple[bool, float]] = _Lru(_MAX_KNOWN)
        self._unknown: _Lru[float] = _Lru(_MAX_UNKNOWN)
        self.failures = FailureLimiter(failures_allowed, failure_window_seconds, clock)
        self._locked_out_lookups = asyncio.Semaphore(_LOCKED_OUT_LOOKUPS)

    async def tenant(self, key: str, address: str) -> str | None:
        """The tenant owning ``key``, or None if the key is unknown or revoked.

        Raises :class:`RateLimited` when ``address`` failed too often and
        ``key`` is not a valid one.
        """
        identity = await self.identify(key, address)
        return identity.tenant if identity is not None else None

    async def key_active(self, key_id: int) -> bool:
        """Whether the key ``key_id`` is still valid, as of at most ``ttl`` ago."""
        now = self.clock()
        cached = self._active.get(str(key_id))
        if cached is not None and cached[1] > now:
            return cached[0]
        async with self.sessions() as session:
            active = await key_is_active(session, key_id)
        self._active.put(str(key_id), (active, now + self.ttl))
        return active

    async def identify(self, key: str, address: str) -> KeyIdentity | None:
        """The id and tenant of ``key``, or None if it is unknown or revoked;
        raises :class:`RateLimited` instead of None when ``address`` is out of
        failures. A valid key is always answered."""
        digest = hash_key(key)
        now = self.clock()
        known = self._known.get(digest)
        if known is not None and known[1] > now:
            return known[0]
        counted = self.failures.retry_after(address) == 0
        if counted:
            self.failures.take(address)
        missed = self._unknown.get(digest)
        if missed is not None and missed > now:
            identity = None
        elif counted:
            identity = await self._look_up(key, digest, now)
        else:
            async with self._locked_out_lookups:
                identity = await self._look_up(key, digest, now)
        if identity is None:
            if not counted:
                raise RateLimited(max(1, self.failures.retry_after(address)))
            return None
        if counted:
            self.failures.give_back(address)
        return identity

    async def _look_up(self, key: str, digest: str, now: float) -> KeyIdentity | None:
        async with self.sessions() as session, session.begin():
            identity = await identify_key(session, key)
        if identity is None:
            self._known.pop(digest)
            self._unknown.put(digest, now + _MISS_TTL)
            return None
        self._unknown.pop(digest)
        self._known.put(digest, (identity, now + self.ttl))
        self._active.put(str(identity.key_id), (True, now + self.ttl))
        return identity
