"""What a hostile or careless client finds (issue #9): a clear 4xx, never a 500.

NUL characters, cursors out of range, bodies too large or not JSON, wrong
methods, floods of bad keys; the API description that says so; and logs
that keep user content and the first-start key out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi import FastAPI
from holdfast_gateway.app import create_app
from holdfast_gateway.auth import KeyAuthenticator, RateLimited, _Lru
from holdfast_shared.content import MAX_MEDIA_ITEM_CHARS, MAX_MEDIA_TOTAL_CHARS
from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.db.models import Message
from holdfast_shared.settings import Settings
from rich.console import Console
from sqlalchemy import select, text
from sqlalchemy.exc import StatementError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.supervisor import _announce_key
from tests.processes import EngineProcesses
from tests.sse_client import execute, replay
from tests.taskids import engine_task_id

pytestmark = pytest.mark.timeout(90)


def assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body: dict[str, Any] = response.json()
    assert body["error"] == code and body["message"], body
    return body


def blamed(body: dict[str, Any]) -> list[str]:
    """The fields a 422's details name, as dotted paths without the location."""
    return [".".join(error["loc"][1:]) for error in body["details"]["errors"]]


def new_name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


# -- 2. NUL characters --------------------------------------------------------

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"message": "before\x00after"}, "message"),
        (
            {"media": [{"type": "image", "media_type": "image/png", "data": PNG, "name": "a\x00"}]},
            "media.0.data.name",
        ),
        ({"media": [{"type": "file", "media_type": "text/\x00", "data": PNG}]}, "media.0.data"),
        (
            {"media": [{"type": "image", "media_type": "image/png", "url": "https://x/\x00"}]},
            "media",
        ),
    ],
)
async def test_nul_in_a_message_or_its_media_is_422_and_stores_nothing(
    engine: EngineProcesses, api_keys: dict[str, str], extra: dict[str, Any], field: str
) -> None:
    key = api_keys["main"]
    name = new_name("nul")
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.post(
            "/execute",
            json={"message": "hello", "task_id": name, **extra},
            headers={"X-Engine-Key": key},
        )
        after = await replay(client, engine.url, key, {"task_id": name, "after": 0})
    body = assert_error(response, 422, "INVALID_REQUEST")
    assert any(path.startswith(field) for path in blamed(body)), body
    assert after.status == 404, "the refused request created the task"


async def test_nul_in_hitl_feedback_is_422_and_the_question_stays_open(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    name = new_name("nul-hitl")
    ask = "/script " + json.dumps({"tool_calls": [{"name": "bash", "input": {"command": "true"}}]})
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
        first = await execute(client, engine.url, key, {"message": ask, "task_id": name}, limit=6)
        assert first.types[-1] == "hitl_request"
        bad = [
            await client.post(
                "/hitl/respond",
                json={"task_id": name, "answer": "no", "feedback": "why\x00not"},
                headers=headers,
            ),
            await client.post(
                "/hitl/respond", json={"task_id": name, "answer": "n\x00o"}, headers=headers
            ),
            await client.post(
                "/hitl/respond",
                json={
                    "task_id": name,
                    "answer": "no",
                    "content_blocks": [{"type": "text", "text": "\x00"}],
                },
                headers=headers,
            ),
        ]
        still = (
            await client.get("/hitl/pending", params={"task_id": name}, headers=headers)
        ).json()
        ok = await client.post(
            "/hitl/respond", json={"task_id": name, "answer": "no"}, headers=headers
        )
        rest = await replay(client, engine.url, key, {"task_id": name})
    for response, field in zip(bad, ["feedback", "answer", "content_blocks"], strict=True):
        body = assert_error(response, 422, "INVALID_REQUEST")
        assert any(path.startswith(field) for path in blamed(body)), body
    assert len(still["pending"]) == 1, "a refused answer was recorded"
    assert ok.status_code == 200, ok.text
    assert rest.events[-1]["phase"] == "completed"


# -- media: a real schema, caps per item and in total ------------------------


async def test_media_items_are_stored_as_given(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    name = new_name("media")
    media = [
        {"type": "image", "media_type": "image/png", "data": PNG, "name": "dot.png"},
        {"type": "file", "media_type": "application/pdf", "url": "https://example.org/a.pdf"},
    ]
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client,
            engine.url,
            api_keys["main"],
            {"message": "look", "task_id": name, "media": media},
        )
    assert got.status == 200 and got.events[-1]["phase"] == "completed"
    task_id = await engine_task_id(sessions, name)
    async with sessions() as session:
        content = await session.scalar(
            select(Message.content).where(Message.task_id == task_id, Message.role == "user")
        )
    assert content is not None and content["media"] == media


@pytest.mark.parametrize(
    ("media", "field"),
    [
        (
            [{"type": "image", "media_type": "image/png", "data": "not base64!"}],
            "media.0.data.data",
        ),
        ([{"type": "sticker", "media_type": "image/png", "data": PNG}], "media.0.data.type"),
        ([{"type": "image", "media_type": "png", "data": PNG}], "media.0.data.media_type"),
        (
            [{"type": "image", "media_type": "image/png", "url": "file:///etc/passwd"}],
            "media.0.url",
        ),
        ([{"type": "image", "media_type": "image/png", "data": PNG, "url": "https://x"}], "media"),
        ([{"type": "image", "media_type": "image/png", "data": PNG}] * 17, "media"),
        (
            [
                {
                    "type": "file",
                    "media_type": "text/plain",
                    "data": "A" * (MAX_MEDIA_ITEM_CHARS + 4),
                }
            ],
            "media.0.data.data",
        ),
        (
            [
                {
                    "type": "file",
                    "media_type": "text/plain",
                    "data": "A" * (MAX_MEDIA_TOTAL_CHARS // 2 + 4),
                }
            ]
            * 2,
            "media",
        ),
    ],
)
async def test_media_outside_the_schema_or_its_caps_is_422(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    media: list[dict[str, Any]],
    field: str,
) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.post(
            "/execute",
            json={"message": "hi", "media": media},
            headers={"X-Engine-Key": api_keys["main"]},
        )
    body = assert_error(response, 422, "INVALID_REQUEST")
    assert any(path.startswith(field) for path in blamed(body)), body


# -- 3. cursors ---------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_task(engine: EngineProcesses, api_keys: dict[str, str]) -> tuple[str, int]:
    """A task with one finished turn: its name and its number of events."""
    name = new_name("cursor")

    async def run() -> int:
        async with httpx.AsyncClient(timeout=30) as client:
            got = await execute(
                client, engine.url, api_keys["main"], {"message": "hi", "task_id": name}
            )
        assert got.events[-1]["phase"] == "completed"
        return len(got.events)

    return name, asyncio.run(run())


@pytest.mark.parametrize(
    ("params", "headers", "field"),
    [
        ({}, {"Last-Event-ID": b"\xb2"}, "Last-Event-ID"),
        ({}, {"Last-Event-ID": "9" * 5000}, "Last-Event-ID"),
        ({}, {"Last-Event-ID": str(2**64 - 1)}, "Last-Event-ID"),
        ({}, {"Last-Event-ID": "-1"}, "Last-Event-ID"),
        ({}, {"Last-Event-ID": "0x10"}, "Last-Event-ID"),
        ({"after_seq": str(2**64 - 1)}, {}, "after_seq"),
        ({"after_seq": "9" * 5000}, {}, "after_seq"),
        ({"after_seq": "\u00b2"}, {}, "after_seq"),
        ({"after": str(2**64 - 1)}, {}, "after"),
        ({"after": str(10**18)}, {}, "after"),
    ],
)
async def test_a_cursor_out_of_range_is_422_before_anything_is_sent(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    finished_task: tuple[str, int],
    params: dict[str, str],
    headers: dict[str, Any],
    field: str,
) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.get(
            "/execute/replay",
            params={"task_id": finished_task[0], **params},
            headers={"X-Engine-Key": api_keys["main"], **headers},
        )
    body = assert_error(response, 422, "INVALID_REQUEST")
    assert field in blamed(body), body


async def test_an_empty_last_event_id_is_no_cursor_and_the_largest_is_the_end(
    engine: EngineProcesses, api_keys: dict[str, str], finished_task: tuple[str, int]
) -> None:
    name, count = finished_task
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        empty = await replay(
            client, engine.url, key, {"task_id": name}, headers={"Last-Event-ID": ""}
        )
        largest = await replay(
            client, engine.url, key, {"task_id": name}, headers={"Last-Event-ID": "9" * 18}
        )
        largest_seq = await replay(
            client, engine.url, key, {"task_id": name, "after_seq": 10**18 - 1}
        )
    assert empty.status == 200 and len(empty.events) == count
    assert largest.status == 200 and largest.events == []
    assert largest_seq.status == 200 and largest_seq.events == []


# -- 4. bodies: size and content type ------------------------------------------


async def _raw_post(
    url: str, head: bytes, first: bytes, *, more: bytes = b""
) -> tuple[int, bytes, int]:
    """Send ``head`` and ``first``, then ``more`` in 256 KiB pieces until an answer
    starts; return its status, its body and how many bytes of ``more`` were sent."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(head + first)
        await writer.drain()
        answer = asyncio.ensure_future(reader.readuntil(b"\r\n\r\n"))
        sent = 0
        while sent < len(more) and not answer.done():
            writer.write(more[sent : sent + 256 * 1024])
            await writer.drain()
            sent += 256 * 1024
            await asyncio.sleep(0.001)
        lines = (await asyncio.wait_for(answer, 10)).decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        body = await reader.readexactly(int(headers["content-length"]))
        return int(lines[0].split()[1]), body, sent
    finally:
        writer.close()


def _head(url: str, path: str, key: str, headers: str) -> bytes:
    host = urlsplit(url).netloc
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nX-Engine-Key: {key}\r\n"
        f"Content-Type: application/json\r\n{headers}\r\n"
    ).encode()


async def test_a_large_declared_body_is_413_before_it_is_read(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    # 10 MB announced, 64 KiB sent: the answer comes without the rest.
    head = _head(engine.url, "/execute", api_keys["main"], f"Content-Length: {10 * 1024**2}\r\n")
    status, body, _ = await _raw_post(engine.url, head, b'{"message": "' + b"x" * 65536)
    assert status == 413 and json.loads(body)["error"] == "BODY_TOO_LARGE"
    # A client that sends it all before reading gets the same answer, not a reset.
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.post(
            "/execute",
            content=b"x" * (10 * 1024**2),
            headers={"X-Engine-Key": api_keys["main"], "content-type": "application/json"},
        )
    assert_error(response, 413, "BODY_TOO_LARGE")


async def test_a_large_chunked_body_is_413_once_it_crosses_the_cap(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    piece = b"x" * (256 * 1024)
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    chunks = chunk * 64  # 16 MiB offered, over the 8 MiB default cap
    head = _head(engine.url, "/execute", api_keys["main"], "Transfer-Encoding: chunked\r\n")
    status, body, sent = await _raw_post(engine.url, head, b"", more=chunks)
    assert status == 413 and json.loads(body)["error"] == "BODY_TOO_LARGE"
    assert sent < len(chunks), "the answer came only after the whole body"


async def test_a_body_under_the_cap_is_read(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.post(
            "/execute",
            content=b'{"message": "' + b"x" * 1_000_001 + b'"}',
            headers={"X-Engine-Key": api_keys["main"], "content-type": "application/json"},
        )
    # Read whole and judged on its content: one character too long.
    body = assert_error(response, 422, "INVALID_REQUEST")
    assert blamed(body) == ["message"]


@pytest.mark.parametrize("path", ["/execute", "/execute/cancel", "/hitl/respond"])
@pytest.mark.parametrize("content_type", ["text/plain", None, "application/x-www-form-urlencoded"])
async def test_a_body_that_is_not_json_is_415(
    engine: EngineProcesses, api_keys: dict[str, str], path: str, content_type: str | None
) -> None:
    headers = {"X-Engine-Key": api_keys["main"]}
    if content_type:
        headers["content-type"] = content_type
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.post(
            path, content=b'{"message": "hi", "task_id": "x", "answer": "yes"}', headers=headers
        )
    assert_error(response, 415, "UNSUPPORTED_MEDIA_TYPE")


async def test_json_with_a_charset_is_json(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.post(
            "/execute/cancel",
            content=b'{"task_id": "no-such-task"}',
            headers={
                "X-Engine-Key": api_keys["main"],
                "content-type": "application/json; charset=utf-8",
            },
        )
    assert_error(response, 404, "TASK_NOT_FOUND")


async def test_a_body_that_is_not_utf8_is_422(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.post(
            "/execute",
            content=b'{"message": "\xff\xfe"}',
            headers={"X-Engine-Key": api_keys["main"], "content-type": "application/json"},
        )
    assert_error(response, 422, "INVALID_REQUEST")


# -- 8. methods, unknown paths, 500s -------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/execute", "POST"),
        ("DELETE", "/execute/replay", "GET"),
        ("PUT", "/hitl/respond", "POST"),
        ("PUT", "/tasks/some-task", "DELETE, GET"),
    ],
)
async def test_a_wrong_method_is_405_with_allow(
    engine: EngineProcesses, method: str, path: str, allowed: str
) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.request(method, path)
    assert_error(response, 405, "METHOD_NOT_ALLOWED")
    assert response.headers["allow"] == allowed


async def test_an_unknown_path_is_a_json_404(engine: EngineProcesses) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        response = await client.get("/nowhere")
    assert_error(response, 404, "NOT_FOUND")


async def test_an_unexpected_exception_is_a_json_500() -> None:
    app: FastAPI = create_app(Settings(redis_url="redis://unused", database_url="postgresql://u/u"))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("something secret went wrong")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.get("/boom")
    body = assert_error(response, 500, "INTERNAL")
    assert "secret" not in response.text and "details" not in body


# -- 7. auth under a flood of bad keys -----------------------------------------


class CountingSessions:
    """A session factory that counts the sessions opened (the key look-ups) and
    the most open at once."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions
        self.opened = 0
        self.open_now = 0
        self.most_open = 0

    @contextlib.asynccontextmanager
    async def __call__(self) -> AsyncIterator[AsyncSession]:
        self.opened += 1
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        try:
            async with self.sessions() as session:
                yield session
        finally:
            self.open_now -= 1


async def test_a_flood_of_random_keys_holds_few_database_connections(
    sessions: async_sessionmaker[AsyncSession], api_keys: dict[str, str]
) -> None:
    now = [1000.0]
    counting = CountingSessions(sessions)
    auth = KeyAuthenticator(
        counting,  # type: ignore[arg-type]
        failures_allowed=20,
        failure_window_seconds=60,
        clock=lambda: now[0],
    )
    assert await auth.tenant(api_keys["main"], "10.0.0.1") == "tenant-main"
    for _ in range(20):
        assert await auth.tenant(f"hf_{secrets.token_urlsafe(32)}", "10.0.0.2") is None
    counting.most_open = 0
    limited = 0

    async def guess() -> None:
        nonlocal limited
        try:
            await auth.tenant(f"hf_{secrets.token_urlsafe(32)}", "10.0.0.2")
        except RateLimited as exc:
            assert exc.retry_after >= 1
            limited += 1

    await asyncio.gather(*(guess() for _ in range(300)))
    # Only failures count, so a locked-out address's keys are still looked up (a
    # valid one among them is answered), but two at a time, not a pool's worth.
    assert limited == 300
    assert counting.most_open <= 2, counting.most_open
    # The known key stays cached through the flood, and another address is not limited.
    opened = counting.opened
    assert await auth.tenant(api_keys["main"], "10.0.0.2") == "tenant-main"
    assert counting.opened == opened
    assert await auth.tenant(f"hf_{secrets.token_urlsafe(8)}", "10.0.0.3") is None
    # A repeated unknown key is answered from the cache of misses.
    repeat = f"hf_{secrets.token_urlsafe(8)}"
    assert await auth.tenant(repeat, "10.0.0.4") is None
    assert await auth.tenant(repeat, "10.0.0.4") is None
    assert counting.opened == opened + 2
    # The bucket refills over the window.
    now[0] += 3.0
    assert await auth.tenant(f"hf_{secrets.token_urlsafe(8)}", "10.0.0.2") is None


def test_the_key_caches_are_bounded_lrus() -> None:
    cache: _Lru[int] = _Lru(3)
    for n in range(5):
        cache.put(str(n), n)
    assert len(cache) == 3 and cache.get("0") is None and cache.get("4") == 4
    cache.get("2")
    cache.put("5", 5)
    assert cache.get("2") == 2 and cache.get("3") is None


@pytest.fixture(scope="module")
def strict_gateway(engine: EngineProcesses) -> Iterator[str]:
    """A gateway with a low failure limit and /docs turned off."""
    gateway = engine.start(
        "gateway",
        env={
            "HOLDFAST_AUTH_FAILURES_ALLOWED": "5",
            "HOLDFAST_DOCS_ENABLED": "false",
            "HOLDFAST_MAX_BODY_BYTES": "65536",
        },
    )
    assert gateway.url is not None
    try:
        yield gateway.url
    finally:
        engine.kill(gateway, signal.SIGTERM)


async def test_a_flood_of_bad_keys_is_429_with_retry_after(
    strict_gateway: str, api_keys: dict[str, str]
) -> None:
    good = {"X-Engine-Key": api_keys["main"]}
    async with httpx.AsyncClient(base_url=strict_gateway, timeout=30) as client:
        assert (await client.get("/hitl/pending", headers=good)).status_code == 200
        flood = await asyncio.gather(
            *(
                client.get("/hitl/pending", headers={"X-Engine-Key": f"hf_{secrets.token_hex(16)}"})
                for _ in range(60)
            )
        )
        still_good = await client.get("/hitl/pending", headers=good)
        no_key = await client.get("/hitl/pending")
    statuses = [r.status_code for r in flood]
    assert statuses.count(401) == 5 and statuses.count(429) == 55, statuses
    limited = next(r for r in flood if r.status_code == 429)
    assert_error(limited, 429, "RATE_LIMITED")
    assert int(limited.headers["retry-after"]) >= 1
    assert still_good.status_code == 200, "a cached valid key still works"
    assert_error(no_key, 401, "INVALID_KEY")


async def test_the_body_cap_is_a_setting(strict_gateway: str, api_keys: dict[str, str]) -> None:
    async with httpx.AsyncClient(base_url=strict_gateway, timeout=30) as client:
        response = await client.post(
            "/execute",
            json={"message": "x" * 70_000},
            headers={"X-Engine-Key": api_keys["main"]},
        )
    assert_error(response, 413, "BODY_TOO_LARGE")


# -- 8. the API description and /docs --------------------------------------------


async def test_the_description_declares_the_key_and_every_error(engine: EngineProcesses) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        spec = (await client.get("/openapi.json")).json()
    assert spec["components"]["securitySchemes"]["EngineKey"] == {
        "type": "apiKey",
        "in": "header",
        "name": "X-Engine-Key",
        "description": spec["components"]["securitySchemes"]["EngineKey"]["description"],
    }
    common = {"401", "422", "429", "500", "503"}
    expected = {
        ("post", "/execute"): common | {"200", "404", "409", "413", "415", "507"},
        ("get", "/execute/replay"): common | {"200", "403", "404"},
        ("post", "/auth/stream-token"): common | {"200", "404", "413", "415"},
        ("post", "/execute/cancel"): common | {"200", "404", "409", "413", "415"},
        ("get", "/hitl/pending"): common | {"200"},
        ("post", "/hitl/respond"): common | {"200", "404", "409", "410", "413", "415"},
        ("delete", "/tasks/{task_id}"): common | {"200", "404", "409"},
        ("get", "/tasks/{task_id}/working-memory"): common | {"200", "404"},
        ("get", "/tasks"): common | {"200", "404"},
        ("get", "/tasks/{task_id}"): common | {"200", "404"},
        ("get", "/tasks/{task_id}/messages"): common | {"200", "404"},
        ("get", "/agents"): common | {"200"},
        ("post", "/agents"): common | {"201", "409", "413", "415"},
        ("get", "/agents/{name}"): common | {"200", "404"},
        ("put", "/agents/{name}"): common | {"200", "404", "409", "413", "415"},
        ("delete", "/agents/{name}"): common | {"204", "404", "409"},
        ("get", "/memory/episodes/search"): common | {"200"},
        ("get", "/memory/knowledge/search"): common | {"200"},
        ("get", "/memory/social/search"): common | {"200"},
        ("post", "/memory/knowledge"): common | {"201", "413", "415"},
        ("get", "/memory/knowledge/{fact_id}"): common | {"200", "404"},
        ("delete", "/memory/knowledge/{fact_id}"): common | {"204", "404"},
        ("get", "/memory/soul"): common | {"200"},
        ("put", "/memory/soul"): common | {"200", "413", "415"},
        ("get", "/memory/soul/versions"): common | {"200"},
        ("get", "/memory/export"): common | {"200"},
        ("post", "/memory/import"): common | {"200", "413", "415", "507"},
        ("delete", "/memory"): common | {"200"},
        ("get", "/learning/status"): common | {"200"},
        ("get", "/skills"): common | {"200"},
        ("post", "/skills"): common | {"201", "409", "413", "415", "507"},
        ("get", "/skills/{name}"): common | {"200", "404"},
        ("delete", "/skills/{name}"): common | {"204", "404", "409"},
        ("post", "/assets/servers"): common | {"201", "409", "413", "415"},
        ("get", "/assets/servers"): common | {"200"},
        ("get", "/assets/servers/{name}"): common | {"200", "404"},
        ("get", "/assets/servers/{name}/tools"): common | {"200", "404"},
        ("delete", "/assets/servers/{name}"): common | {"204", "404"},
        ("get", "/assets/servers/{name}/connect"): common | {"200", "404", "409"},
        # The authorization server sends the browser here: no API key, the state names it.
        ("get", "/assets/oauth/callback"): {"200", "400", "404", "422", "500", "503"},
        ("get", "/health"): {"200", "401", "429", "500", "503"},
        ("post", "/v1/execution"): common | {"201", "404", "413", "415", "507"},
        ("get", "/v1/execution"): common | {"200"},
        ("get", "/v1/execution/{execution_id}"): common | {"200", "404"},
        ("delete", "/v1/execution/{execution_id}"): common | {"204", "404", "409"},
        ("put", "/v1/execution/{execution_id}/checkpoint"): common | {"201", "404", "413", "415"},
        ("post", "/v1/execution/{execution_id}/pause"): common | {"202", "404", "409"},
        ("post", "/v1/execution/{execution_id}/resume"): common | {"200", "404", "409", "413"},
        ("get", "/tasks/{task_id}/files"): common | {"200", "400", "404", "409"},
        ("get", "/tasks/{task_id}/files/{path}"): common
        | {"200", "206", "400", "404", "409", "416"},
        ("put", "/tasks/{task_id}/files/{path}"): common
        | {"201", "400", "404", "409", "413", "507"},
        ("delete", "/tasks/{task_id}/files/{path}"): common | {"204", "400", "404", "409"},
        ("get", "/v1/execution/{execution_id}/checkpoints/{checkpoint_id}/files"): common
        | {"200", "400", "404"},
        ("get", "/v1/execution/{execution_id}/checkpoints/{checkpoint_id}/files/{path}"): common
        | {"200", "206", "400", "404", "409", "416"},
        ("get", "/schedules"): common | {"200"},
        ("post", "/schedules"): common | {"201", "404", "409", "413", "415"},
        ("get", "/schedules/{name}"): common | {"200", "404"},
        ("delete", "/schedules/{name}"): common | {"204", "404"},
        ("post", "/schedules/{name}/pause"): common | {"200", "404"},
        ("post", "/schedules/{name}/resume"): common | {"200", "404"},
        ("get", "/schedules/{name}/runs"): common | {"200", "404"},
        ("post", "/webhooks/secret"): common | {"201"},
        ("get", "/webhooks/default"): common | {"200"},
        ("put", "/webhooks/default"): common | {"200", "413", "415"},
        ("delete", "/webhooks/default"): common | {"204"},
        ("get", "/webhooks/deliveries"): common | {"200"},
        ("get", "/webhooks/deliveries/{delivery_id}"): common | {"200", "404"},
        ("post", "/webhooks/deliveries/{delivery_id}/redeliver"): common | {"202", "404"},
    }
    found = {
        (method, path): set(operation["responses"])
        for path, item in spec["paths"].items()
        for method, operation in item.items()
    }
    assert found == expected
    for (method, path), _ in expected.items():
        operation = spec["paths"][path][method]
        if path not in ("/health", "/assets/oauth/callback"):
            assert operation["security"] == [{"EngineKey": []}]
        for status, response in operation["responses"].items():
            if status.startswith(("4", "5")) and path != "/health":
                ref = response["content"]["application/json"]["schema"]["$ref"]
                assert ref == "#/components/schemas/ErrorBody"
    for path, method in (("/execute", "post"), ("/execute/replay", "get")):
        frame = spec["paths"][path][method]["responses"]["200"]["content"]["text/event-stream"]
        data = frame["schema"]["properties"]["data"]
        assert data["contentSchema"] == {"$ref": "#/components/schemas/Event"}
    assert "thread_lifecycle" in json.dumps(spec["components"]["schemas"]["Event"])


async def test_docs_load_nothing_from_a_cdn(engine: EngineProcesses, strict_gateway: str) -> None:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as client:
        page = await client.get("/docs")
        script = await client.get("/docs/assets/swagger-ui-bundle.js")
        css = await client.get("/docs/assets/swagger-ui.css")
        redoc = await client.get("/redoc")
    async with httpx.AsyncClient(base_url=strict_gateway, timeout=30) as client:
        off = await client.get("/docs")
        spec = await client.get("/openapi.json")
    assert page.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in page.text
    assert "https://" not in page.text and "http://" not in page.text
    assert script.status_code == 200 and len(script.content) > 100_000
    assert css.status_code == 200
    assert redoc.status_code == 404
    assert off.status_code == 404 and spec.status_code == 200


# -- 6. logs --------------------------------------------------------------------


async def test_sql_errors_do_not_carry_the_parameters(database_url: str) -> None:
    engine = create_engine(database_url, pool_size=1)
    try:
        async with session_factory(engine)() as session:
            with pytest.raises(StatementError) as raised:
                await session.execute(text("SELECT CAST(:v AS text)"), {"v": "user secret\x00"})
    finally:
        await engine.dispose()
    assert "user secret" not in str(raised.value)
    assert "parameters hidden" in str(raised.value)


@pytest.mark.parametrize("terminal", [True, False])
def test_the_first_start_key_is_printed_only_to_a_terminal(terminal: bool, tmp_path: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=120)
    _announce_key(console, "hf_the-new-key", tmp_path / "api-key")
    assert ("hf_the-new-key" in out.getvalue()) is terminal
    assert str(tmp_path / "api-key") in out.getvalue().replace("\n", "").replace("│", "")
