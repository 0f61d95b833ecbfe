"""The bad-key limiter counts the real client and never refuses a valid key
(security issue #23, defect 4).

uvicorn believed ``X-Forwarded-For`` from 127.0.0.1 by default, so a local
guesser sending a new address each time was never limited; and a lockout
refused every key the gateway had not cached, the valid ones too. Now the
forwarded headers count only from ``HOLDFAST_TRUSTED_PROXIES``, and only
failures count.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
from collections.abc import Iterator

import httpx
import pytest
from holdfast_gateway.auth import KeyAuthenticator, RateLimited
from holdfast_shared.settings import Settings
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.processes import EngineProcesses

pytestmark = pytest.mark.timeout(120)

ALLOWED = 5


def _gateway(engine: EngineProcesses, **env: str) -> Iterator[str]:
    gateway = engine.start("gateway", env={"HOLDFAST_AUTH_FAILURES_ALLOWED": str(ALLOWED), **env})
    assert gateway.url is not None
    try:
        yield gateway.url
    finally:
        engine.kill(gateway, signal.SIGTERM)


@pytest.fixture(scope="module")
def untrusting_gateway(engine: EngineProcesses) -> Iterator[str]:
    yield from _gateway(engine)


@pytest.fixture(scope="module")
def proxied_gateway(engine: EngineProcesses) -> Iterator[str]:
    yield from _gateway(engine, HOLDFAST_TRUSTED_PROXIES="127.0.0.1")


def _bad_key() -> dict[str, str]:
    return {"X-Engine-Key": f"hf_{secrets.token_hex(16)}"}


def _forwarded(n: int) -> dict[str, str]:
    return {"X-Forwarded-For": f"203.0.113.{n}"}


async def test_forwarded_addresses_are_ignored_unless_the_proxy_is_trusted(
    untrusting_gateway: str, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=untrusting_gateway, timeout=30) as client:
        statuses = [
            (await client.get("/hitl/pending", headers={**_bad_key(), **_forwarded(n)})).status_code
            for n in range(4 * ALLOWED)
        ]
        # Locked out: a valid key this gateway has never seen is still answered.
        unseen = await client.get("/hitl/pending", headers={"X-Engine-Key": api_keys["other"]})
        still_limited = await client.get("/hitl/pending", headers=_bad_key())
    assert statuses == [401] * ALLOWED + [429] * 3 * ALLOWED, statuses
    assert unseen.status_code == 200, unseen.text
    assert still_limited.status_code == 429
    assert still_limited.json()["error"] == "RATE_LIMITED"
    assert int(still_limited.headers["retry-after"]) >= 1


async def test_a_trusted_proxy_names_the_client(
    proxied_gateway: str, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=proxied_gateway, timeout=30) as client:
        # Each client behind the proxy has a bucket of its own...
        spread = await asyncio.gather(
            *(
                client.get("/hitl/pending", headers={**_bad_key(), **_forwarded(n)})
                for n in range(3 * ALLOWED)
            )
        )
        # ...and one client is limited, whatever the others do.
        one = [
            (await client.get("/hitl/pending", headers={**_bad_key(), **_forwarded(200)}))
            for _ in range(ALLOWED + 2)
        ]
        valid = await client.get(
            "/hitl/pending", headers={"X-Engine-Key": api_keys["main"], **_forwarded(200)}
        )
    assert [r.status_code for r in spread] == [401] * 3 * ALLOWED
    assert [r.status_code for r in one] == [401] * ALLOWED + [429] * 2
    assert valid.status_code == 200, valid.text


async def test_a_locked_out_address_still_gets_its_valid_keys_answered(
    sessions: async_sessionmaker[AsyncSession], api_keys: dict[str, str]
) -> None:
    auth = KeyAuthenticator(sessions, failures_allowed=2, failure_window_seconds=3600)
    for _ in range(2):
        assert await auth.tenant(f"hf_{secrets.token_urlsafe(32)}", "10.9.0.1") is None

    async def guess() -> None:
        with pytest.raises(RateLimited):
            await auth.tenant(f"hf_{secrets.token_urlsafe(32)}", "10.9.0.1")

    flood = [asyncio.create_task(guess()) for _ in range(50)]
    # Neither key was seen by this authenticator: both are looked up amid the flood.
    assert await auth.tenant(api_keys["other"], "10.9.0.1") == "tenant-other"
    assert await auth.tenant(api_keys["main"], "10.9.0.1") == "tenant-main"
    await asyncio.gather(*flood)
    # Valid keys gave back nothing they had not taken: the address is still locked out.
    assert auth.failures.retry_after("10.9.0.1") >= 1


def test_trusted_proxies_are_addresses_or_networks() -> None:
    stores = {"redis_url": "redis://unused", "database_url": "postgresql://u/u"}
    settings = Settings(**stores, trusted_proxies=" 10.0.0.0/8, 127.0.0.1,::1 ")
    assert settings.trusted_proxy_list == ["10.0.0.0/8", "127.0.0.1", "::1"]
    assert Settings(**stores).trusted_proxy_list == [], "none by default"
    with pytest.raises(ValidationError, match="not an IP address or CIDR"):
        Settings(**stores, trusted_proxies="proxy.internal")
