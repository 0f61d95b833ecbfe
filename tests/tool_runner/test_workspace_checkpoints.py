"""Workspace checkpoints off the tool-runner's disk, restores, and hibernation.

The archive itself (tree.py with both stores) is tested in process against the
real PostgreSQL and a directory; the tool-runner's use of it (restore before a
call on a wiped disk, hibernation, the request helpers) against a real engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import stat
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Task, Tenant, WorkspaceArchive
from holdfast_shared.ids import new_id, new_task_id
from holdfast_shared.jobs import WorkspaceReply, WorkspaceRequest
from holdfast_shared.keys import Keys
from holdfast_shared.workspace_checkpoints import (
    ArchiveStore,
    DirectoryStore,
    Manifest,
    ManifestError,
    PostgresStore,
    WorkspaceRequestError,
    WorkspaceRequestTimeout,
    checkpoint_workspace,
    restore_workspace,
)
from holdfast_tool_runner.workspace_tree import checkpoint, restore
from redis.asyncio import Redis
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute
from tests.taskids import TENANTS, engine_task_id

pytestmark = pytest.mark.timeout(120)

TENANT = "tenant-wsa"


# -- the archive, in process, on both stores ----------------------------------------


@pytest.fixture(params=["postgres", "directory"])
async def store(
    request: pytest.FixtureRequest,
    sessions: async_sessionmaker[AsyncSession],
    tmp_path: Path,
) -> ArchiveStore:
    if request.param == "postgres":
        return PostgresStore(sessions)
    return DirectoryStore(tmp_path / "store")


@pytest.fixture
async def task_id(sessions: async_sessionmaker[AsyncSession]) -> str:
    """A task row of its own tenant (archives reference their task)."""
    tenant = f"{TENANT}-{secrets.token_hex(4)}"
    task = new_task_id()
    async with sessions.begin() as session:
        await session.execute(
            insert(Tenant).values(id=tenant, name="workspace archives").on_conflict_do_nothing()
        )
        session.add(Task(id=task, tenant_id=tenant, name=task))
    return f"{tenant}/{task}"


def split(ids: str) -> tuple[str, str]:
    tenant, _, task = ids.partition("/")
    return tenant, task


def tree(root: Path) -> dict[str, Any]:
    """Everything under ``root`` that an archive keeps, comparable with ==."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), path.read_bytes(), st.st_mtime_ns)
    return out


def build(root: Path) -> None:
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty" / "nested-empty").mkdir(parents=True)
    (root / "src" / "pkg" / "main.py").write_text("print('hello')\n")
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    (root / "secret.txt").write_text("only mine")
    (root / "secret.txt").chmod(0o600)
    (root / "blob.bin").write_bytes(os.urandom(200_000))
    (root / "zero").write_bytes(b"")
    (root / "copy-a.txt").write_text("same content")
    (root / "copy-b.txt").write_text("same content")
    os.symlink("src/pkg/main.py", root / "link-inside")
    os.symlink("/etc/passwd", root / "link-outside")
    os.symlink("does/not/exist", root / "dangling")
    (root / "readonly").mkdir()
    (root / "readonly" / "kept.txt").write_text("in a read-only directory")
    (root / "readonly").chmod(0o555)


def change(root: Path) -> None:
    (root / "src" / "pkg" / "main.py").write_text("print('changed')\n")
    (root / "secret.txt").unlink()
    (root / "new.txt").write_text("new")
    (root / "run.sh").chmod(0o644)
    (root / "link-inside").unlink()
    (root / "link-inside").write_text("now a file")
    shutil.rmtree(root / "empty")
    (root / "readonly").chmod(0o755)
    shutil.rmtree(root / "readonly")
    os.symlink("/", root / "readonly")


async def test_checkpoint_change_restore_gives_the_exact_tree_back(
    store: ArchiveStore, task_id: str, tmp_path: Path
) -> None:
    tenant, task = split(task_id)
    root = tmp_path / "ws"
    root.mkdir()
    build(root)
    before = tree(root)
    first = await checkpoint(store, tenant, task, root, reason="test")
    assert first.created and first.files_read == 8

    change(root)
    changed = tree(root)
    second = await checkpoint(
        store, tenant, task, root, previous=first.manifest, previous_id=first.archive_id
    )
    assert second.created and second.archive_id != first.archive_id
    # Only the new and rewritten files were read again.
    assert second.files_read == 3
    assert await store.head(tenant, task) == second.archive_id

    # Roll back in place: exactly the first tree, mtimes included.
    manifest = await store.manifest(tenant, task, first.archive_id)
    assert manifest is not None
    await restore(store, tenant, root, manifest, previous=second.manifest)
    assert tree(root) == before

    # And forward again, into an empty directory on "another machine".
    elsewhere = tmp_path / "elsewhere"
    second_manifest = await store.manifest(tenant, task, second.archive_id)
    assert second_manifest is not None
    await restore(store, tenant, elsewhere, second_manifest)
    assert tree(elsewhere) == changed
    # Symlinks come back as links, pointing where they pointed, never followed.
    assert os.readlink(elsewhere / "readonly") == "/"
    assert os.readlink(root / "link-outside") == "/etc/passwd"
    (root / "readonly").chmod(0o755)


async def test_unchanged_files_are_stored_once_and_not_read_again(
    store: ArchiveStore, task_id: str, tmp_path: Path
) -> None:
    tenant, task = split(task_id)
    root = tmp_path / "ws"
    root.mkdir()
    for i in range(20):
        (root / f"f{i}.txt").write_text(f"content {i % 5}")  # 5 distinct contents
    first = await checkpoint(store, tenant, task, root)
    assert await store.blob_count(tenant) == 5
    assert first.blobs_stored == 5

    again = await checkpoint(
        store, tenant, task, root, previous=first.manifest, previous_id=first.archive_id
    )
    assert not again.created and again.archive_id == first.archive_id
    assert again.files_read == 0 and again.blobs_stored == 0

    (root / "f3.txt").write_text("something else entirely")
    (root / "f4.txt").write_text("content 0")  # a content already stored
    third = await checkpoint(
        store, tenant, task, root, previous=first.manifest, previous_id=first.archive_id
    )
    assert third.created and third.files_read == 2 and third.blobs_stored == 1
    assert await store.blob_count(tenant) == 6


HOSTILE: list[list[Any]] = [
    ["../escape", "f", 0o644, 1, 0, "0" * 64],
    ["/etc/passwd", "f", 0o644, 1, 0, "0" * 64],
    ["a/../../escape", "d", 0o755],
    ["a//b", "d", 0o755],
    ["./x", "l", "/"],
    ["nul\x00name", "d", 0o755],
    ["", "d", 0o755],
    ["x", "f", 0o644, -1, 0, "0" * 64],
    ["x", "f", 0o644, 1, 0, "not-a-hash"],
    ["x", "z", 0o644],
]


@pytest.mark.parametrize("entry", HOSTILE, ids=[repr(e[0]) for e in HOSTILE])
def test_hostile_manifest_entries_are_refused(entry: list[Any]) -> None:
    with pytest.raises(ManifestError):
        Manifest.load({"version": 1, "entries": [entry]})


async def test_a_stored_manifest_that_writes_through_a_symlink_is_refused(
    store: ArchiveStore, task_id: str, tmp_path: Path, sessions: async_sessionmaker[AsyncSession]
) -> None:
    tenant, task = split(task_id)
    outside = tmp_path / "outside"
    outside.mkdir()
    hostile = {
        "version": 1,
        "entries": [
            ["link", "l", str(outside)],
            ["link/planted", "f", 0o644, 1, 0, "0" * 64],
        ],
    }
    archive_id = new_id("wsa")
    if isinstance(store, PostgresStore):
        async with sessions.begin() as session:
            session.add(
                WorkspaceArchive(
                    id=archive_id,
                    tenant_id=tenant,
                    task_id=task,
                    manifest=hostile,
                    files=1,
                    total_bytes=1,
                    reason="test",
                )
            )
    else:
        assert isinstance(store, DirectoryStore)
        path = store.root / "archives" / tenant / task / f"{archive_id}.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"reason": "test", "manifest": hostile}))
    with pytest.raises(ManifestError, match="not a directory"):
        await store.manifest(tenant, task, archive_id)
    assert list(outside.iterdir()) == []
    # Another task's archive is not this one's.
    assert await store.manifest(tenant, new_task_id(), archive_id) is None


# -- the tool-runner: restore before a call, hibernation, requests -------------------

HIBERNATE_AFTER = 1.5


@pytest.fixture(scope="module")
def archive_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("archive-workspaces")


@pytest.fixture(scope="module")
def archive_engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    archive_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """A gateway, a loop-worker and a tool-runner whose idle workspaces hibernate fast."""
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}wsa:",
        HOLDFAST_WORKSPACE_ROOT=str(archive_root),
        # A plain directory: ``rm -rf`` of the root is then a wiped disk.
        HOLDFAST_WORKSPACE_FS="none",
        HOLDFAST_WORKSPACE_HIBERNATE_AFTER_SECONDS=str(HIBERNATE_AFTER),
        HOLDFAST_TOOL_PERMISSIONS=json.dumps({"*": {"write_file": "allow", "read_file": "allow"}}),
    )
    with running_engine(env, runners=1, directory=tmp_path_factory.mktemp("wsa-engine")) as e:
        yield e


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as c:
        yield c


def tool_script(*calls: dict[str, Any]) -> str:
    return "/script " + json.dumps({"text": "", "tool_calls": list(calls)})


async def call_tool(
    client: httpx.AsyncClient, base: str, key: str, name: str, tool: str, args: dict[str, Any]
) -> dict[str, Any]:
    got = await execute(
        client,
        base,
        key,
        {"message": tool_script({"name": tool, "input": args}), "task_id": name},
    )
    assert got.events[-1]["phase"] == "completed", got.events
    results = [e for e in got.events if e["type"] == "tool_result"]
    assert len(results) == 1, got.events
    return dict(results[0])


async def wait_for(check: Any, what: str, within: float = 15.0) -> Any:
    for _ in range(int(within / 0.1)):
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {within} s")


async def archived_with(store: ArchiveStore, tenant: str, task: str, path: str) -> str | None:
    """The task's head, once it holds ``path``."""
    head = await store.head(tenant, task)
    if head is None:
        return None
    manifest = await store.manifest(tenant, task, head)
    return head if manifest is not None and path in manifest.entries else None


async def test_a_wiped_workspace_is_restored_before_the_next_tool_call(
    archive_engine: EngineProcesses,
    archive_root: Path,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    key, name = api_keys["main"], f"wiped-{secrets.token_hex(4)}"
    written = await call_tool(
        client,
        archive_engine.url,
        key,
        name,
        "write_file",
        {"path": "notes/todo.txt", "content": "remember the milk"},
    )
    assert "error" not in written, written
    task = await engine_task_id(sessions, name)
    store = PostgresStore(sessions)
    # The turn's end archived it.
    await wait_for(
        lambda: archived_with(store, TENANTS["main"], task, "notes/todo.txt"), "turn-end archive"
    )
    shutil.rmtree(archive_root)  # the disk is gone, the engine keeps running

    read = await call_tool(
        client, archive_engine.url, key, name, "read_file", {"path": "notes/todo.txt"}
    )
    assert "error" not in read, read
    assert read["output"]["content"] == "remember the milk"
    assert (archive_root / TENANTS["main"] / task / "notes" / "todo.txt").exists()


async def test_an_idle_workspace_hibernates_and_comes_back(
    archive_engine: EngineProcesses,
    archive_root: Path,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    key, name = api_keys["main"], f"sleepy-{secrets.token_hex(4)}"
    await call_tool(
        client, archive_engine.url, key, name, "write_file", {"path": "a.txt", "content": "zzz"}
    )
    task = await engine_task_id(sessions, name)
    workspace = archive_root / TENANTS["main"] / task
    assert workspace.is_dir()

    async def released() -> bool:
        return not workspace.exists()

    await wait_for(released, "hibernation", within=HIBERNATE_AFTER + 10)
    store = PostgresStore(sessions)
    assert await archived_with(store, TENANTS["main"], task, "a.txt")

    read = await call_tool(client, archive_engine.url, key, name, "read_file", {"path": "a.txt"})
    assert read["output"]["content"] == "zzz"
    assert (workspace / "a.txt").read_text() == "zzz"


async def test_checkpoint_and_restore_requests(
    archive_engine: EngineProcesses,
    archive_root: Path,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
    redis_prefix: str,
) -> None:
    keys = Keys(f"{redis_prefix}wsa:")
    tenant, name = TENANTS["main"], f"rollback-{secrets.token_hex(4)}"
    # No workspace yet (an unknown task): nothing to archive.
    assert await checkpoint_workspace(redis, keys, tenant_id=tenant, task_id=new_task_id()) is None

    key = api_keys["main"]
    await call_tool(
        client, archive_engine.url, key, name, "write_file", {"path": "v.txt", "content": "one"}
    )
    task = await engine_task_id(sessions, name)
    first = await checkpoint_workspace(redis, keys, tenant_id=tenant, task_id=task)
    assert first is not None
    # Unchanged: the same archive.
    assert await checkpoint_workspace(redis, keys, tenant_id=tenant, task_id=task) == first

    await call_tool(
        client, archive_engine.url, key, name, "write_file", {"path": "v.txt", "content": "two"}
    )
    await call_tool(
        client, archive_engine.url, key, name, "write_file", {"path": "extra.txt", "content": "x"}
    )
    second = await checkpoint_workspace(redis, keys, tenant_id=tenant, task_id=task)
    assert second not in (None, first)

    # A redelivered request (the same request id) is answered from the first
    # result, not carried out again: a restore redelivered after later work
    # must not roll that work back.
    request = WorkspaceRequest(
        request_id=secrets.token_hex(8),
        tenant_id=tenant,
        task_id=task,
        action="restore",
        archive_id=first,
        reply_to=keys.workspace_reply(f"test-{secrets.token_hex(4)}"),
    )
    for attempt in range(2):
        await redis.xadd(keys.tools, request.to_fields())
        answered = await redis.blpop([request.reply_to], timeout=20)  # type: ignore[misc]
        assert answered is not None
        assert WorkspaceReply.model_validate_json(answered[1]).archive_id == first
        if attempt == 0:
            await call_tool(
                client,
                archive_engine.url,
                key,
                name,
                "write_file",
                {"path": "v.txt", "content": "3"},
            )
    read = await call_tool(client, archive_engine.url, key, name, "read_file", {"path": "v.txt"})
    assert read["output"]["content"] == "3"

    await restore_workspace(redis, keys, tenant_id=tenant, task_id=task, archive_id=first)
    read = await call_tool(client, archive_engine.url, key, name, "read_file", {"path": "v.txt"})
    assert read["output"]["content"] == "one"
    gone = await call_tool(
        client, archive_engine.url, key, name, "read_file", {"path": "extra.txt"}
    )
    assert "error" in gone

    # None: an empty workspace.
    await restore_workspace(redis, keys, tenant_id=tenant, task_id=task, archive_id=None)
    emptied = await call_tool(client, archive_engine.url, key, name, "read_file", {"path": "v.txt"})
    assert "error" in emptied

    with pytest.raises(WorkspaceRequestError, match="no workspace archive"):
        await restore_workspace(
            redis, keys, tenant_id=tenant, task_id=task, archive_id="wsa_not_there"
        )
    # Nobody consumes this prefix's stream: a clear timeout, not a hang.
    with pytest.raises(WorkspaceRequestTimeout, match="no tool-runner answered"):
        await checkpoint_workspace(
            redis, Keys(f"{redis_prefix}nobody:"), tenant_id=tenant, task_id=task, timeout=0.3
        )


async def test_another_runner_without_the_workspace_restores_it(
    archive_engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    sessions: async_sessionmaker[AsyncSession],
    tmp_path: Path,
) -> None:
    """Another machine: a runner on a disk of its own takes over. (Last in the
    module: it replaces the engine's tool-runner.)"""
    key, name = api_keys["main"], f"moved-{secrets.token_hex(4)}"
    await call_tool(
        client, archive_engine.url, key, name, "write_file", {"path": "d/e.txt", "content": "here"}
    )
    task = await engine_task_id(sessions, name)
    store = PostgresStore(sessions)
    await wait_for(lambda: archived_with(store, TENANTS["main"], task, "d/e.txt"), "archive")

    other_root = tmp_path / "other-machine"
    # The environment sets every process's workspace root; this one's is its own.
    own_root = (
        "import os, sys; os.environ['HOLDFAST_WORKSPACE_ROOT'] = sys.argv[1]; "
        "from holdfast_tool_runner.main import main; main()"
    )
    archive_engine.start("tool-runner", command=[sys.executable, "-c", own_root, str(other_root)])
    archive_engine.kill(archive_engine.runners[0], signal.SIGTERM)

    read = await call_tool(client, archive_engine.url, key, name, "read_file", {"path": "d/e.txt"})
    assert "error" not in read, read
    assert read["output"]["content"] == "here"
    assert (other_root / TENANTS["main"] / task / "d" / "e.txt").read_text() == "here"
