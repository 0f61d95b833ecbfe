"""One wire-protocol server per provider test module, emptied before each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.providers.wire import WireServer


@pytest.fixture(scope="module")
def server() -> Iterator[WireServer]:
    wire = WireServer().start()
    yield wire
    wire.stop()


@pytest.fixture
def wire(server: WireServer) -> WireServer:
    server.replies.clear()
    server.requests.clear()
    return server
