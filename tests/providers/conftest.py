"""One wire-protocol server per provider test module, emptied before each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.providers import fake_anthropic, fake_gemini, fake_openai
from tests.providers.wire import WireServer


@pytest.fixture(scope="module")
def server() -> Iterator[WireServer]:
    # Each API's own checks, each for its own paths: a request the real API
    # refuses is refused here too.
    checks = (fake_anthropic.refuse, fake_openai.refuse, fake_gemini.refuse)
    wire = WireServer(checks).start()
    yield wire
    wire.stop()


@pytest.fixture
def wire(server: WireServer) -> WireServer:
    server.replies.clear()
    server.requests.clear()
    return server
