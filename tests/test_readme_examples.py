"""The README's Python SDK example, run as a user would: against the session's
engine, with the key and URL from the environment, as its comment says."""

from __future__ import annotations

import asyncio
import os
import re
import sys
from pathlib import Path

import pytest

from tests.processes import EngineProcesses

pytestmark = pytest.mark.timeout(120)

README = Path(__file__).resolve().parents[1] / "README.md"


def sdk_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    found = [b for b in blocks if "from holdfast_client import Client" in b]
    assert len(found) == 1, "the README has one Client example"
    return found[0]


async def test_the_sdk_example_prints_each_output_on_its_own_line(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    env = {**os.environ, "HOLDFAST_URL": engine.url, "HOLDFAST_API_KEY": api_keys["main"]}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        sdk_example(),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=90)
    assert process.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    # The scripted model (no provider key) echoes the message; the streamed text
    # once ran straight into the next print, with no newline between.
    assert lines[0] == "You said: hello", lines
    assert re.fullmatch(r"task: \S+", lines[1]), lines
    assert lines[2] == "transcript: You said: hello", lines
