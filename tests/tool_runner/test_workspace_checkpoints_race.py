"""The workspace archive never reads or writes outside the workspace, even while a
process of the task swaps a directory for a symlink to a host directory as it goes
(security issue #23: a checkpoint archived the host directory, and a resume from it
handed the host's files to the task).

The archive (tree.py) is called in process against a real directory store; the
swapping runs in a process of its own, so it races the archiver for real on
another core.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
from holdfast_shared.workspace_checkpoints import ArchiveStore, DirectoryStore, Manifest
from holdfast_tool_runner.workspace_tree import ArchiveError, checkpoint, restore

pytestmark = pytest.mark.timeout(180)

TENANT, TASK = "tenant-race", "task-race"
SECRET = b"root-only host secret " + os.urandom(16).hex().encode()
NESTED = b"a host file whose name was never given " + os.urandom(16).hex().encode()
OWN = b"the task's own file in d"
SIBLINGS = 300
CHECKPOINTS = 50

# Swaps ``d`` (the real directory) and ``d.swap`` (a symlink to the host directory)
# atomically (renameat2 RENAME_EXCHANGE), as fast as it can, until killed: ``d`` is
# always one or the other, never missing.
SWAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
os.chdir(sys.argv[1])
os.symlink(sys.argv[2], "d.swap")
print("ready", flush=True)
while True:
    if libc.renameat2(-100, b"d", -100, b"d.swap", 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")
"""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A host directory the task must never see: a 0600 file and a nested one."""
    outside = tmp_path / "host"
    (outside / "nested" / "deeper").mkdir(parents=True)
    (outside / "secret.txt").write_bytes(SECRET)
    (outside / "secret.txt").chmod(0o600)
    (outside / "nested" / "deeper" / "unnamed.bin").write_bytes(NESTED)
    return outside


def host_state(outside: Path) -> dict[str, tuple[int, bytes | None]]:
    found: dict[str, tuple[int, bytes | None]] = {}
    for path in sorted(outside.rglob("*")):
        st = path.lstat()
        found[str(path.relative_to(outside))] = (
            st.st_mode,
            path.read_bytes() if path.is_file() else None,
        )
    return found


@pytest.fixture
def swapper(tmp_path: Path, host: Path) -> Iterator[Path]:
    """A workspace whose ``d`` a process keeps swapping for a symlink to ``host``."""
    root = tmp_path / "ws"
    (root / "d").mkdir(parents=True)
    (root / "d" / "own.txt").write_bytes(OWN)
    # Siblings widen the window between listing ``d`` and entering it.
    for i in range(SIBLINGS):
        (root / f"sib{i:03}").mkdir()
        (root / f"sib{i:03}" / "f.txt").write_text(f"sibling {i}")
    process = subprocess.Popen(
        [sys.executable, "-c", SWAPPER, str(root), str(host)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        yield root
    finally:
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


async def test_a_directory_swapped_for_a_symlink_never_archives_host_files(
    swapper: Path, host: Path, tmp_path: Path
) -> None:
    store = DirectoryStore(tmp_path / "store")
    before = host_state(host)
    host_hashes = {sha(SECRET), sha(NESTED)}
    previous: Manifest | None = None
    previous_id: str | None = None
    links = dirs = 0
    for _ in range(CHECKPOINTS):
        try:
            result = await checkpoint(
                store, TENANT, TASK, swapper, previous=previous, previous_id=previous_id
            )
        except ArchiveError:
            continue  # a file changed under it: refused, nothing stored
        entries = result.manifest.entries
        assert not host_hashes & result.manifest.hashes(), "host bytes in the manifest"
        for path, entry in entries.items():
            top, _, below = path.partition("/")
            if top in ("d", "d.swap") and below:
                # Only the real directory's own file, never a name of the host's.
                assert below == "own.txt", path
                assert entry.sha256 == sha(OWN), path
        kind = entries["d"].kind if "d" in entries else None
        links += kind == "link"
        dirs += kind == "dir"
        previous, previous_id = result.manifest, result.archive_id
    # The swap did race the checkpoints (both states were archived).
    assert links and dirs, (links, dirs)
    assert await store.get_blobs(TENANT, host_hashes) == {}
    assert host_state(host) == before


class SwapBeforeWriting:
    """A store that, when the restore first asks for blobs (its directories are
    made, its files not yet written), has ``swap`` run: what a process of the task
    could do at that moment."""

    def __init__(self, store: DirectoryStore, swap: Path, host: Path) -> None:
        self.store = store
        self.swap = swap
        self.host = host
        self.swapped = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def get_blobs(self, tenant_id: str, hashes: Collection[str]) -> dict[str, bytes]:
        if not self.swapped:
            self.swapped = True
            self.swap.rename(self.swap.with_name("moved"))
            self.swap.symlink_to(self.host)
        return await self.store.get_blobs(tenant_id, hashes)


async def test_a_restore_never_writes_through_a_directory_swapped_for_a_symlink(
    host: Path, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    (source / "d" / "deeper").mkdir(parents=True)
    (source / "d" / "planted.txt").write_text("would land in the host directory")
    (source / "d" / "deeper" / "planted.txt").write_text("and here")
    (source / "d" / "secret.txt").write_text("would overwrite the host's secret")
    directory = DirectoryStore(tmp_path / "store")
    archived = await checkpoint(directory, TENANT, TASK, source)
    before = host_state(host)

    target = tmp_path / "target"
    store: ArchiveStore = SwapBeforeWriting(directory, target / "d", host)  # type: ignore[assignment]
    with pytest.raises(ArchiveError, match="stopped being a directory"):
        await restore(store, TENANT, target, archived.manifest)
    assert host_state(host) == before
    assert os.readlink(target / "d") == str(host)

    # Restored again (the task's processes reaped), the tree is whole: the link goes,
    # what it points to stays.
    await restore(directory, TENANT, target, archived.manifest)
    assert (target / "d" / "deeper" / "planted.txt").read_text() == "and here"
    assert host_state(host) == before


async def test_removing_a_tree_never_follows_a_symlink_in_it(host: Path, tmp_path: Path) -> None:
    """A restore removes what the archive lacks; a symlink inside is removed
    itself, never what it points to."""
    store = DirectoryStore(tmp_path / "store")
    target = tmp_path / "target"
    target.mkdir()
    empty = await checkpoint(store, TENANT, TASK, target)
    (target / "gone" / "deep").mkdir(parents=True)
    (target / "gone" / "deep" / "to-host").symlink_to(host)
    (target / "gone" / "readonly").mkdir()
    (target / "gone" / "readonly" / "f").write_text("x")
    (target / "gone" / "readonly").chmod(0o555)
    (target / "top-link").symlink_to(host)
    before = host_state(host)
    await restore(store, TENANT, target, empty.manifest)
    assert list(target.iterdir()) == []
    assert host_state(host) == before
