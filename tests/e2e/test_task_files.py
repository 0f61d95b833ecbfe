"""A task's files over HTTP (``/tasks/{id}/files``, a checkpoint's files): list,
download (chunked, Range), upload, delete; never through a symlink or out of the
workspace; writes refused during a turn but under ``inputs/``; a hibernated
workspace read back from its archive — real processes, the scripted model."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import engine_env
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute
from tests.taskids import workspace_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """A gateway, a loop-worker and a tool-runner that may run bash, whose idle
    workspaces hibernate after 3 s, with a 1 MiB body limit."""
    workspaces = tmp_path_factory.mktemp("files-workspaces")
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}files:",
        HOLDFAST_WORKSPACE_ROOT=str(workspaces),
        HOLDFAST_TOOL_PERMISSIONS=json.dumps({"*": {"bash": "allow"}}),
        HOLDFAST_WORKSPACE_HIBERNATE_AFTER_SECONDS="3",
        HOLDFAST_MAX_BODY_BYTES=str(1024 * 1024),
    )
    with running_engine(env, workers=1, runners=1, directory=tmp_path_factory.mktemp("files")) as p:
        p.workspaces = workspaces  # type: ignore[attr-defined]
        yield p


@pytest.fixture
async def client(cluster: EngineProcesses, api_keys: dict[str, str]) -> AsyncIterator[Api]:
    async with httpx.AsyncClient(timeout=60) as http:
        yield Api(http, cluster.url, api_keys["main"])


class Api:
    def __init__(self, http: httpx.AsyncClient, base: str, key: str) -> None:
        self.http = http
        self.base = base
        self.key = key

    async def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"X-Engine-Key": self.key, **kw.pop("headers", {})}
        return await self.http.request(method, f"{self.base}{path}", headers=headers, **kw)

    async def bash(self, task_id: str, command: str) -> None:
        message = "/script " + json.dumps(
            {"tool_calls": [{"name": "bash", "input": {"command": command}}]}
        )
        got = await execute(
            self.http, self.base, self.key, {"message": message, "task_id": task_id}
        )
        assert got.events[-1]["phase"] == "completed", got.events


def error_of(reply: httpx.Response) -> str:
    assert reply.headers["content-type"].startswith("application/json"), reply.text
    code: str = reply.json()["error"]
    return code


async def until(predicate: Any, within: float = 30) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while not await predicate():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.05)


async def test_list_download_upload_delete(
    cluster: EngineProcesses,
    client: Api,
    sessions: Any,
    tmp_path: Path,
    api_keys: dict[str, str],
) -> None:
    task = f"files-{secrets.token_hex(4)}"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    await client.bash(
        task,
        "mkdir -p out && printf hello > out/a.txt && head -c 3000000 /dev/urandom > big.bin"
        f" && ln -s {outside} away && ln -s {outside}/secret secret-link",
    )
    root = await workspace_of(sessions, cluster.workspaces, task)  # type: ignore[attr-defined]
    big = (root / "big.bin").read_bytes()

    listed = await client.call("GET", f"/tasks/{task}/files")
    assert listed.status_code == 200, listed.text
    by_path = {f["path"]: f for f in listed.json()["files"]}
    assert {p: f["kind"] for p, f in by_path.items()} == {
        "away": "link",
        "big.bin": "file",
        "out": "dir",
        "secret-link": "link",
    }
    assert by_path["big.bin"]["size"] == 3_000_000
    assert by_path["big.bin"]["sha256"] == hashlib.sha256(big).hexdigest()
    assert by_path["big.bin"]["download"] == f"/tasks/{task}/files/big.bin"
    assert by_path["away"]["download"] is None
    deep = await client.call("GET", f"/tasks/{task}/files", params={"recursive": "true"})
    a_txt = next(f for f in deep.json()["files"] if f["path"] == "out/a.txt")
    assert a_txt["sha256"] == hashlib.sha256(b"hello").hexdigest() and a_txt["name"] == "a.txt"
    sub = await client.call("GET", f"/tasks/{task}/files", params={"path": "out"})
    assert [f["path"] for f in sub.json()["files"]] == ["out/a.txt"]

    # Downloads: a small one, a 3 MB one in several chunks, ranges.
    small = await client.call("GET", f"/tasks/{task}/files/out/a.txt")
    assert small.status_code == 200 and small.content == b"hello"
    assert small.headers["content-type"].startswith("text/plain")
    assert small.headers["etag"] == f'"{hashlib.sha256(b"hello").hexdigest()}"'
    assert small.headers["x-content-type-options"] == "nosniff"
    whole = await client.call("GET", by_path["big.bin"]["download"])
    assert whole.status_code == 200 and whole.content == big
    part = await client.call(
        "GET", f"/tasks/{task}/files/big.bin", headers={"Range": "bytes=1048570-1048589"}
    )
    assert part.status_code == 206 and part.content == big[1048570:1048590]
    assert part.headers["content-range"] == "bytes 1048570-1048589/3000000"
    tail = await client.call("GET", f"/tasks/{task}/files/big.bin", headers={"Range": "bytes=-5"})
    assert tail.status_code == 206 and tail.content == big[-5:]
    past = await client.call(
        "GET", f"/tasks/{task}/files/big.bin", headers={"Range": "bytes=3000000-"}
    )
    assert past.status_code == 416 and error_of(past) == "RANGE_NOT_SATISFIABLE"
    assert past.headers["content-range"] == "bytes */3000000"

    # Never through a symlink, never out of the workspace.
    for path in ("away/secret", "secret-link", "nothing-here", ".skills/x"):
        reply = await client.call("GET", f"/tasks/{task}/files/{path}")
        assert reply.status_code == 404 and error_of(reply) == "FILE_NOT_FOUND", path
    through = await client.call("GET", f"/tasks/{task}/files", params={"path": "away"})
    assert through.status_code == 404 and error_of(through) == "FILE_NOT_FOUND"
    # Refused by the description's pattern (422) or the gateway's own check (400).
    refused = {(400, "INVALID_PATH"), (422, "INVALID_REQUEST"), (404, "NOT_FOUND")}
    for raw in ("%2E%2E/%2E%2E/etc/passwd", "out/%2E%2E/%2E%2E/x", "/etc/passwd", "a%5Cb"):
        reply = await client.call("GET", f"/tasks/{task}/files/{raw}")
        assert (reply.status_code, error_of(reply)) in refused, raw
    for directory in ("..", "out/../..", "/etc", "a\\b"):
        reply = await client.call("GET", f"/tasks/{task}/files", params={"path": directory})
        assert (reply.status_code, error_of(reply)) in refused, directory
    a_dir = await client.call("GET", f"/tasks/{task}/files/out")
    assert a_dir.status_code == 409 and error_of(a_dir) == "INVALID_PATH"
    too_long = await client.call("GET", f"/tasks/{task}/files/{'é' * 200}")
    assert too_long.status_code == 404 and error_of(too_long) == "FILE_NOT_FOUND"

    # Uploads: directories made; not through a link; over the body limit, 413.
    put = await client.call(
        "PUT", f"/tasks/{task}/files/inputs/new/data.csv", content=b"a,b\n1,2\n"
    )
    assert put.status_code == 201, put.text
    assert put.json()["sha256"] == hashlib.sha256(b"a,b\n1,2\n").hexdigest()
    assert (root / "inputs/new/data.csv").read_bytes() == b"a,b\n1,2\n"
    again = await client.call("GET", f"/tasks/{task}/files/inputs/new/data.csv")
    assert again.content == b"a,b\n1,2\n"
    replaced = await client.call("PUT", f"/tasks/{task}/files/secret-link", content=b"mine")
    assert replaced.status_code == 201, replaced.text
    assert (outside / "secret").read_text() == "host secret", "written through the link"
    assert (root / "secret-link").read_bytes() == b"mine" and not (
        root / "secret-link"
    ).is_symlink()
    into = await client.call("PUT", f"/tasks/{task}/files/away/planted", content=b"x")
    assert (into.status_code, error_of(into)) in {(409, "INVALID_PATH"), (404, "FILE_NOT_FOUND")}
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    over_dir = await client.call("PUT", f"/tasks/{task}/files/out", content=b"x")
    assert over_dir.status_code == 409 and error_of(over_dir) == "INVALID_PATH"
    too_big = await client.call(
        "PUT", f"/tasks/{task}/files/inputs/huge.bin", content=b"x" * (1024 * 1024 + 1)
    )
    assert too_big.status_code == 413 and error_of(too_big) == "BODY_TOO_LARGE"
    assert not (root / "inputs/huge.bin").exists()

    # Deletes: a directory with what it holds, a symlink itself.
    gone = await client.call("DELETE", f"/tasks/{task}/files/out")
    assert gone.status_code == 204, gone.text
    assert not (root / "out").exists()
    link_gone = await client.call("DELETE", f"/tasks/{task}/files/away")
    assert link_gone.status_code == 204
    assert (outside / "secret").read_text() == "host secret"
    missing = await client.call("DELETE", f"/tasks/{task}/files/out")
    assert missing.status_code == 404 and error_of(missing) == "FILE_NOT_FOUND"

    # Another tenant's key sees no such task.
    other = Api(client.http, client.base, api_keys["other"])
    for method in ("GET", "PUT", "DELETE"):
        reply = await other.call(method, f"/tasks/{task}/files/big.bin", content=b"x")
        assert reply.status_code == 404 and error_of(reply) == "TASK_NOT_FOUND", method


async def test_writes_wait_for_the_turn_but_inputs(
    cluster: EngineProcesses, client: Api, sessions: Any
) -> None:
    task = f"files-busy-{secrets.token_hex(4)}"
    await client.bash(task, "echo one > notes.txt")
    message = "/script " + json.dumps(
        {"tool_calls": [{"name": "bash", "input": {"command": "sleep 4"}}]}
    )
    turn = asyncio.create_task(
        execute(client.http, client.base, client.key, {"message": message, "task_id": task})
    )

    async def running() -> bool:
        reply = await client.call("GET", f"/tasks/{task}")
        return bool(reply.json()["status"] == "running")

    await until(running)
    refused = await client.call("PUT", f"/tasks/{task}/files/notes.txt", content=b"two")
    assert refused.status_code == 409 and error_of(refused) == "TURN_IN_PROGRESS"
    deleting = await client.call("DELETE", f"/tasks/{task}/files/notes.txt")
    assert deleting.status_code == 409 and error_of(deleting) == "TURN_IN_PROGRESS"
    handed = await client.call("PUT", f"/tasks/{task}/files/inputs/hint.txt", content=b"go on")
    assert handed.status_code == 201, handed.text
    read = await client.call("GET", f"/tasks/{task}/files/notes.txt")
    assert read.status_code == 200 and read.content == b"one\n"
    got = await turn
    assert got.events[-1]["phase"] == "completed"
    after = await client.call("PUT", f"/tasks/{task}/files/notes.txt", content=b"two")
    assert after.status_code == 201, after.text


async def test_a_hibernated_workspace_is_read_from_its_archive(
    cluster: EngineProcesses, client: Api, sessions: Any
) -> None:
    task = f"files-idle-{secrets.token_hex(4)}"
    await client.bash(task, "mkdir -p outputs && echo report > outputs/report.md")
    root = await workspace_of(sessions, cluster.workspaces, task)  # type: ignore[attr-defined]

    async def hibernated() -> bool:
        return not root.exists()

    await until(hibernated, within=60)
    listed = await client.call("GET", f"/tasks/{task}/files", params={"path": "outputs"})
    assert listed.status_code == 200, listed.text
    assert [f["path"] for f in listed.json()["files"]] == ["outputs/report.md"]
    got = await client.call("GET", f"/tasks/{task}/files/outputs/report.md")
    assert got.status_code == 200 and got.content == b"report\n"


async def test_a_checkpoints_files(cluster: EngineProcesses, client: Api) -> None:
    message = "/script " + json.dumps(
        {"tool_calls": [{"name": "bash", "input": {"command": "echo v1 > state.txt"}}]}
    )
    created = await client.call("POST", "/v1/execution", json={"name": "files", "input": message})
    assert created.status_code == 201, created.text
    execution_id = created.json()["id"]

    async def completed() -> bool:
        reply = await client.call("GET", f"/v1/execution/{execution_id}")
        return bool(reply.json()["status"] == "completed")

    await until(completed)
    saved = await client.call("PUT", f"/v1/execution/{execution_id}/checkpoint", json={})
    assert saved.status_code == 201, saved.text
    checkpoint = saved.json()["id"]
    changed = await client.call("PUT", f"/tasks/{execution_id}/files/state.txt", content=b"v2\n")
    assert changed.status_code == 201, changed.text

    base = f"/v1/execution/{execution_id}/checkpoints/{checkpoint}/files"
    listed = await client.call("GET", base)
    assert listed.status_code == 200, listed.text
    files = listed.json()["files"]
    assert [(f["path"], f["download"]) for f in files] == [("state.txt", f"{base}/state.txt")]
    old = await client.call("GET", f"{base}/state.txt")
    assert old.status_code == 200 and old.content == b"v1\n"
    ranged = await client.call("GET", f"{base}/state.txt", headers={"Range": "bytes=1-"})
    assert ranged.status_code == 206 and ranged.content == b"1\n"
    now = await client.call("GET", f"/tasks/{execution_id}/files/state.txt")
    assert now.content == b"v2\n"
    for path, code in (("nope.txt", "FILE_NOT_FOUND"),):
        reply = await client.call("GET", f"{base}/{path}")
        assert reply.status_code == 404 and error_of(reply) == code
    unknown = await client.call("GET", f"/v1/execution/{execution_id}/checkpoints/ckpt_x/files")
    assert unknown.status_code == 404 and error_of(unknown) == "CHECKPOINT_NOT_FOUND"


async def test_files_written_under_outputs_are_artifact_events(
    cluster: EngineProcesses, client: Api
) -> None:
    task = f"files-art-{secrets.token_hex(4)}"
    command = "mkdir -p outputs/charts && printf report > outputs/r.md && echo x > scratch.txt"
    message = "/script " + json.dumps(
        {
            "tool_calls": [
                {"name": "bash", "input": {"command": command}},
                {"name": "bash", "input": {"command": "echo only-scratch > scratch.txt"}},
            ]
        }
    )
    got = await execute(client.http, client.base, client.key, {"message": message, "task_id": task})
    assert got.events[-1]["phase"] == "completed", got.events
    artifacts = [e for e in got.events if e["type"] == "artifact"]
    assert [(a["path"], a["name"], a["size"]) for a in artifacts] == [("outputs/r.md", "r.md", 6)]
    published = artifacts[0]
    assert published["sha256"] == hashlib.sha256(b"report").hexdigest()
    assert published["download"] == f"/tasks/{task}/files/outputs/r.md"
    results = [e for e in got.events if e["type"] == "tool_result"]
    assert published["tool_call_id"] == results[0]["tool_call_id"]
    assert got.events.index(results[0]) < got.events.index(published)
    downloaded = await client.call("GET", published["download"])
    assert downloaded.status_code == 200 and downloaded.content == b"report"
