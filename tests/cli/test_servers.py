"""The tests' server discovery (tests/servers.py): quick and clean when Docker cannot help."""

from __future__ import annotations

import contextlib
import gc
import http.server
import json
import socketserver
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests import servers


class _FakeEngine(http.server.BaseHTTPRequestHandler):
    """A Docker engine on a unix socket that has only ``present`` and can pull nothing."""

    present: frozenset[str] = frozenset()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _reply(self, status: int, body: object) -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        path = unquote(urlsplit(self.path).path)
        if path.endswith("/_ping"):
            self._reply(200, "OK")
        elif path.endswith("/version"):
            self._reply(200, {"ApiVersion": "1.45", "MinAPIVersion": "1.24", "Version": "28.2.2"})
        elif "/images/" in path and path.endswith("/json"):
            image = path.split("/images/", 1)[1].removesuffix("/json")
            if image in self.present:
                self._reply(200, {"Id": "sha256:" + "0" * 64, "RepoTags": [image]})
            else:
                self._reply(404, {"message": f"No such image: {image}"})
        else:
            self._reply(404, {"message": "page not found"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if "/images/create" in self.path:
            # What an engine without network says.
            self._reply(
                500,
                {
                    "message": 'Get "https://registry-1.docker.io/v2/": dial tcp: '
                    "lookup registry-1.docker.io: no such host"
                },
            )
        else:
            self._reply(404, {"message": "page not found"})


@contextlib.contextmanager
def fake_engine(path: Path, present: frozenset[str] = frozenset()) -> Iterator[None]:
    handler = type("Engine", (_FakeEngine,), {"present": present})
    server = socketserver.ThreadingUnixStreamServer(str(path), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def leftovers() -> list[str]:
    """What the garbage collector finds left open: ResourceWarnings, however reported."""
    found: list[str] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda u: found.append(f"{u.exc_type.__name__}: {u.exc_value}")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gc.collect()
    finally:
        sys.unraisablehook = previous
    return found + [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.fixture
def no_discovery_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOLDFAST_TEST_SERVERS", "HOLDFAST_TEST_REDIS_URL", "HOLDFAST_TEST_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "DOCKER_CONTEXT"):
        monkeypatch.delenv(name, raising=False)


def test_no_docker_engine_leaves_nothing_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_discovery_env: None
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/docker.sock")
    leftovers()
    started = time.monotonic()
    reason = servers.docker_unusable(["redis:7"])
    assert time.monotonic() - started < 2
    assert reason is not None and "no Docker engine listens" in reason
    assert leftovers() == []


def test_an_engine_that_cannot_pull_means_embedded_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_discovery_env: None
) -> None:
    sock = tmp_path / "docker.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{sock}")
    with fake_engine(sock, present=frozenset({"redis:7"})):
        leftovers()
        assert servers.docker_unusable(["redis:7"]) is None
        started = time.monotonic()
        reason = servers.docker_unusable(["redis:7", "pgvector/pgvector:pg16"])
        assert time.monotonic() - started < 5
    assert reason is not None
    assert "pgvector/pgvector:pg16 is not here and cannot be pulled" in reason
    assert leftovers() == []


def test_modes(monkeypatch: pytest.MonkeyPatch, no_discovery_env: None) -> None:
    def docker_says(reason: str | None) -> None:
        monkeypatch.setattr(servers, "_testcontainers_unusable", lambda: reason)

    docker_says("no Docker engine listens on /var/run/docker.sock")
    assert servers.server_kind("HOLDFAST_TEST_REDIS_URL") == "embedded"
    monkeypatch.setenv("HOLDFAST_TEST_SERVERS", "testcontainers")
    with pytest.raises(RuntimeError, match="no Docker engine listens"):
        servers.server_kind("HOLDFAST_TEST_REDIS_URL")

    docker_says(None)
    assert servers.server_kind("HOLDFAST_TEST_REDIS_URL") == "testcontainers"
    monkeypatch.setenv("HOLDFAST_TEST_SERVERS", "auto")
    assert servers.server_kind("HOLDFAST_TEST_REDIS_URL") == "testcontainers"
    monkeypatch.setenv("HOLDFAST_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    assert servers.server_kind("HOLDFAST_TEST_REDIS_URL") == "url"

    # Embedded whatever is set or running, without asking Docker.
    monkeypatch.setenv("HOLDFAST_TEST_SERVERS", "embedded")
    monkeypatch.setattr(servers, "_testcontainers_unusable", lambda: pytest.fail("asked Docker"))
    assert servers.server_kind("HOLDFAST_TEST_REDIS_URL") == "embedded"

    monkeypatch.setenv("HOLDFAST_TEST_SERVERS", "docker")
    with pytest.raises(RuntimeError, match="expected one of auto, embedded, testcontainers"):
        servers.server_kind("HOLDFAST_TEST_REDIS_URL")
