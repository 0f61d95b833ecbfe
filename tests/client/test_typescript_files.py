"""The TypeScript client's file calls (``test/files.test.mjs``) against the session engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.client.test_typescript_client import engine_env, node_test, passed, ts_package
from tests.processes import EngineProcesses

__all__ = ["ts_package"]  # the fixture, shared with test_typescript_client

pytestmark = pytest.mark.timeout(180)


def test_files_against_the_engine(
    ts_package: Path, engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    output = passed(node_test(ts_package, ["files.test.mjs"], engine_env(engine, api_keys["main"])))
    assert "# pass 1" in output, output
