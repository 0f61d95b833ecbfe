"""Stream tokens: ``POST /auth/stream-token`` and ``GET /execute/replay?token=``.

The token stands in for the API key where a client cannot set headers (a
browser's EventSource). Checked here: it replays its task, honours
Last-Event-ID as the browser's reconnect sends it, and is refused with a JSON
code when it is for another task, tampered with, expired or malformed. Signing
and checking are also tested on their own with a clock passed in.
"""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from holdfast_gateway.errors import ApiError
from holdfast_gateway.streamtokens import StreamTokens, secret_from_settings
from holdfast_shared.settings import Settings
from httpx_sse import aconnect_sse

from tests.conftest import ASSET_KEY
from tests.processes import EngineProcesses
from tests.sse_client import execute

# The first test to need it waits for the session engine to start.
pytestmark = pytest.mark.timeout(120)


# ---- the signer alone ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_token_carries_its_grant_and_expires() -> None:
    clock = Clock()
    tokens = StreamTokens(b"s" * 32, ttl_seconds=300, clock=clock)
    grant = tokens.issue("tenant-a", "tk_123", "my-task", 7)
    token = tokens.encode(grant)
    assert tokens.decode(token) == grant
    assert grant.expires_at == 1_800_000_300
    clock.now += 299
    assert tokens.decode(token) == grant
    clock.now += 1
    with pytest.raises(ApiError) as expired:
        tokens.decode(token)
    assert (expired.value.status, expired.value.code) == (401, "STREAM_TOKEN_EXPIRED")


@pytest.mark.parametrize(
    "mangle",
    [
        lambda t: t[:-2] + ("AA" if not t.endswith("AA") else "BB"),  # signature
        lambda t: "v2" + t[2:],  # version
        lambda t: t.replace(".", "", 1),  # shape
        lambda t: t + "." + t,  # shape
        lambda t: "x" * 3000,  # size
        lambda t: "",
        lambda t: t[:-1] + "é",  # not ASCII
        lambda t: "v1.é.é",
    ],
)
def test_a_tampered_or_malformed_token_is_refused(mangle: Any) -> None:
    tokens = StreamTokens(b"s" * 32, ttl_seconds=300)
    token = tokens.encode(tokens.issue("tenant-a", "tk_1", "t", 1))
    with pytest.raises(ApiError) as refused:
        tokens.decode(mangle(token))
    assert (refused.value.status, refused.value.code) == (401, "STREAM_TOKEN_INVALID")


def test_a_payload_changed_under_its_signature_is_refused() -> None:
    tokens = StreamTokens(b"s" * 32, ttl_seconds=300)
    version, _, signature = tokens.encode(tokens.issue("tenant-a", "tk_1", "t", 1)).split(".")
    other = tokens.encode(tokens.issue("tenant-b", "tk_1", "t", 1)).split(".")[1]
    with pytest.raises(ApiError) as refused:
        tokens.decode(f"{version}.{other}.{signature}")
    assert refused.value.code == "STREAM_TOKEN_INVALID"


def test_another_secret_does_not_open_a_token() -> None:
    mine = StreamTokens(b"a" * 32, ttl_seconds=300)
    theirs = StreamTokens(b"b" * 32, ttl_seconds=300)
    with pytest.raises(ApiError):
        theirs.decode(mine.encode(mine.issue("t", "tk", "n", 1)))


def test_the_secret_is_its_own_setting_or_derived_from_the_asset_key() -> None:
    derived = secret_from_settings(Settings(asset_encryption_key=ASSET_KEY))
    assert derived != ASSET_KEY.encode() and len(derived) == 32
    # Rotation adds keys after the first: the tokens' secret does not change.
    assert secret_from_settings(Settings(asset_encryption_key=f"{ASSET_KEY},other")) == derived
    own = "x" * 40
    assert secret_from_settings(Settings(stream_token_secret=own)) == own.encode()
    with pytest.raises(RuntimeError, match="HOLDFAST_STREAM_TOKEN_SECRET"):
        secret_from_settings(Settings(asset_encryption_key=None, stream_token_secret=None))


# ---- through the gateway -------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as http:
        yield http


@pytest.fixture(scope="module")
async def finished_task(engine: EngineProcesses, api_keys: dict[str, str]) -> tuple[str, list[int]]:
    """A task with one finished turn, and the seqs of its events."""
    name = f"st-{secrets.token_hex(4)}"
    message = "/script " + json.dumps({"text": "one two three four"})
    async with httpx.AsyncClient(timeout=30) as http:
        got = await execute(
            http, engine.url, api_keys["main"], {"message": message, "task_id": name}
        )
    assert got.events[-1]["phase"] == "completed"
    return name, got.seqs


async def token_for(client: httpx.AsyncClient, base: str, key: str, task_id: str) -> str:
    response = await client.post(
        f"{base}/auth/stream-token", json={"task_id": task_id}, headers={"X-Engine-Key": key}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["task_id"] == task_id and body["expires_at"] > 0
    token: str = body["token"]
    assert key not in token
    return token


async def replay_with(
    client: httpx.AsyncClient,
    base: str,
    params: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, list[int], Any]:
    """Status, seqs and error body of a replay sent without X-Engine-Key."""
    async with aconnect_sse(
        client, "GET", f"{base}/execute/replay", params=params, headers=headers or {}
    ) as source:
        if source.response.status_code != 200:
            await source.response.aread()
            return source.response.status_code, [], source.response.json()
        seqs = [
            int(sse.id) for sse in [s async for s in source.aiter_sse()] if sse.event != "heartbeat"
        ]
        return 200, seqs, None


async def test_a_token_replays_its_task_without_the_key(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    finished_task: tuple[str, list[int]],
) -> None:
    name, seqs = finished_task
    token = await token_for(client, engine.url, api_keys["main"], name)
    status, got, _ = await replay_with(client, engine.url, {"task_id": name, "token": token})
    assert status == 200 and got == seqs


async def test_a_reconnect_with_last_event_id_and_the_token_goes_on_after_it(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    finished_task: tuple[str, list[int]],
) -> None:
    name, seqs = finished_task
    token = await token_for(client, engine.url, api_keys["main"], name)
    # As an EventSource reconnects: the same URL (after_seq=0 in it), plus the header.
    status, got, _ = await replay_with(
        client,
        engine.url,
        {"task_id": name, "after_seq": 0, "token": token},
        headers={"Last-Event-ID": str(seqs[2])},
    )
    assert status == 200 and got == seqs[3:]


async def test_a_token_for_another_task_or_tenant_is_refused(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    finished_task: tuple[str, list[int]],
) -> None:
    name, _ = finished_task
    token = await token_for(client, engine.url, api_keys["main"], name)
    status, _, body = await replay_with(
        client, engine.url, {"task_id": "some-other-task", "token": token}
    )
    assert status == 403 and body["error"] == "STREAM_TOKEN_WRONG_TASK"
    # Another tenant cannot get a token for this task: it is not theirs to see.
    other = await client.post(
        f"{engine.url}/auth/stream-token",
        json={"task_id": name},
        headers={"X-Engine-Key": api_keys["other"]},
    )
    assert other.status_code == 404 and other.json()["error"] == "TASK_NOT_FOUND"


async def test_tampered_expired_and_missing_credentials_are_refused_with_a_code(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    finished_task: tuple[str, list[int]],
) -> None:
    name, _ = finished_task
    token = await token_for(client, engine.url, api_keys["main"], name)
    tampered = token[:-3] + ("AAA" if not token.endswith("AAA") else "BBB")
    status, _, body = await replay_with(client, engine.url, {"task_id": name, "token": tampered})
    assert status == 401 and body["error"] == "STREAM_TOKEN_INVALID"

    # The test knows the engine's asset key, so it can sign as the gateway
    # does, with a clock an hour behind.
    gateway_secret = secret_from_settings(Settings(asset_encryption_key=ASSET_KEY))
    genuine = StreamTokens(gateway_secret, 300).decode(token)
    past = StreamTokens(gateway_secret, 300, clock=lambda: genuine.expires_at - 3900.0)
    expired = past.encode(
        past.issue(genuine.tenant, genuine.task_id, genuine.task_name, genuine.key_id)
    )
    status, _, body = await replay_with(client, engine.url, {"task_id": name, "token": expired})
    assert status == 401 and body["error"] == "STREAM_TOKEN_EXPIRED"

    status, _, body = await replay_with(client, engine.url, {"task_id": name})
    assert status == 401 and body["error"] == "INVALID_KEY"


async def test_bad_requests_for_a_token_name_the_field(
    engine: EngineProcesses, api_keys: dict[str, str], client: httpx.AsyncClient
) -> None:
    headers = {"X-Engine-Key": api_keys["main"]}
    url = f"{engine.url}/auth/stream-token"
    for body in ({}, {"task_id": "bad id!"}, {"task_id": "x", "extra": 1}):
        response = await client.post(url, json=body, headers=headers)
        assert response.status_code == 422, body
        assert response.json()["error"] == "INVALID_REQUEST"
    missing = await client.post(url, json={}, headers=headers)
    assert "task_id" in missing.json()["message"]
    unknown = await client.post(url, json={"task_id": "no-such-task-here"}, headers=headers)
    assert unknown.status_code == 404
    keyless = await client.post(url, json={"task_id": "x"})
    assert keyless.status_code == 401 and keyless.json()["error"] == "INVALID_KEY"
    text = await client.post(url, content="task_id=x", headers=headers)
    assert text.status_code == 415


def test_a_token_shows_neither_its_tenant_nor_its_task_in_any_decoding() -> None:
    tokens = StreamTokens(b"s" * 32, ttl_seconds=300)
    tenant, task_id, name = "tenant-opaque-7f3a", "tk_opaque_91c2d4", "task-opaque-55e0"
    token = tokens.encode(tokens.issue(tenant, task_id, name, 424242))
    readings = [token.encode()]
    for part in token.split("."):
        for start in range(4):  # every alignment of a base64 reading
            chunk = part[start:]
            chunk = chunk[: len(chunk) - len(chunk) % 4]
            for decode in (base64.urlsafe_b64decode, base64.b64decode):
                with contextlib.suppress(ValueError):
                    readings.append(decode(chunk))
    for secret in (tenant, task_id, name, "424242"):
        assert all(secret.encode() not in reading for reading in readings), secret
    # Still a working token.
    assert tokens.decode(token).task_id == task_id
