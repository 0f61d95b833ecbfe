"""The README's examples, run as a user would against the session's engine: the
Python SDK example with the key and URL from the environment, as its comment
says, and the "Using it" curl block with the key where ``holdfast up`` saves it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from holdfast.testing.timescale import scaled
from tests.isolation import fresh_tenant_keys  # noqa: F401
from tests.processes import EngineProcesses

pytestmark = pytest.mark.timeout(120)

README = Path(__file__).resolve().parents[2] / "README.md"


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


# The address the README's curl commands use: holdfast up's default gateway.
README_URL = "http://127.0.0.1:8000"
# curl prints this after each response (from the HOME's .curlrc), so the test
# tells the block's responses apart without changing a command.
CURLRC = 'silent\nshow-error\nwrite-out = "\\n@@ %{http_code} %{method} %{url_effective}\\n"\n'


def using_it_block() -> str:
    section = README.read_text().split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1, "Using it has one sh block"
    return blocks[0]


@dataclass
class Response:
    status: int
    method: str
    url: str
    body: str

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line[6:]) for line in self.body.splitlines() if line[:6] == "data: "]

    def text(self) -> str:
        return "".join(e["text"] for e in self.events() if e["type"] == "text_delta")

    def json(self) -> Any:
        # The last line: a `grep` of the block may have printed before the response.
        return json.loads(self.body.splitlines()[-1])


def responses(out: str) -> list[Response]:
    found = []
    body_start = 0
    for mark in re.finditer(r"^@@ (\d{3}) (\S+) (\S+)$", out, flags=re.MULTILINE):
        body = out[body_start : mark.start()].strip("\n")
        found.append(Response(int(mark[1]), mark[2], mark[3], body))
        body_start = mark.end()
    return found


async def test_the_using_it_block_does_what_each_comment_says(
    engine: EngineProcesses, tenant_keys: dict[str, str], tmp_path: Path
) -> None:
    """Run in order as one pasted block, on a tenant with no tasks yet, as on a
    fresh holdfast up; /hitl/respond once answered 404 and /execute/cancel 409,
    with no prompt waiting and no turn running (issue #25, 2)."""
    assert shutil.which("curl"), "the README's block needs curl"
    home = tmp_path / "home"
    (home / ".holdfast").mkdir(parents=True)
    (home / ".holdfast" / "api-key").write_text(tenant_keys["main"] + "\n")
    (home / ".curlrc").write_text(CURLRC)
    work = tmp_path / "work"
    work.mkdir()
    script = "set -euo pipefail\n" + using_it_block().replace(README_URL, engine.url)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CURL_HOME": str(home)}
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        script,
        cwd=work,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out_bytes, err = await asyncio.wait_for(process.communicate(), timeout=scaled(90))
    finally:
        if process.returncode is None:
            process.kill()
    out = out_bytes.decode()
    assert process.returncode == 0, f"{err.decode()}\n{out}"
    got = responses(out)
    said = [(r.status, r.method, r.url.removeprefix(engine.url)) for r in got]
    assert [r.status for r in got] == [200] * len(got), said
    hello, again, listing, pending, respond, ada, replay, from_5, notes, cancel, delete, *health = (
        got
    )
    assert hello.text() == "You said: hello"
    assert again.text() == "You said: what did I just say? Earlier you said: hello"
    assert ada.text().startswith("You said: My name is Ada")
    kinds = [e["type"] for e in listing.events()]
    assert "tool_call" in kinds and "tool_result" in kinds, kinds
    assert listing.text().startswith("Tool results: "), listing.text()
    [asked] = pending.json()["pending"]
    assert asked["task_id"] == "demo-1" and asked["tool_call"]["tool"] == "bash", asked
    assert respond.json() == {"status": "resumed", "request_id": asked["request_id"]}
    # The background turn, answered: bash ran and the turn completed.
    bash_turn = responses((work / "bash.sse").read_text())[0]
    results = [e for e in bash_turn.events() if e["type"] == "tool_result"]
    assert results and results[0]["output"]["stdout"] == "hi from bash\n", bash_turn.body
    assert bash_turn.events()[-1]["phase"] == "completed"
    assert '"stdout":"hi from bash\\n"' in out  # what `grep tool_result bash.sse` shows
    assert [e["seq"] for e in replay.events()] == list(range(1, len(replay.events()) + 1))
    assert from_5.events()[0]["seq"] == 6
    assert notes.json()["task_id"] == "demo-1"
    assert cancel.json()["status"] == "cancelling"
    long_turn = responses((work / "long.sse").read_text())[0]
    last = long_turn.events()[-1]
    assert (last["phase"], last["stop_reason"]) == ("completed", "cancelled"), last
    assert long_turn.text().count("tick") < 300
    assert '"stop_reason":"cancelled"' in out  # what `grep stop_reason long.sse` shows
    assert delete.json() == {"status": "deleted", "task_id": "demo-2"}
    assert [h.json()["status"] for h in health] == ["ok", "ok"]
    assert "subsystems" in health[1].json()
