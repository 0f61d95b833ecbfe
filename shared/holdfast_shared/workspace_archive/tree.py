"""Checkpoint a workspace directory into an archive store, and restore one.

Incremental both ways, against the manifest this disk last wrote or restored
(``previous``): a file whose size and mtime match its entry there is taken to be
unchanged and not read again (the same trust ``rsync`` and ``make`` put in
mtimes; a restore sets every file's mtime, so a restored tree matches its
manifest). A checkpoint reads and hashes only the other files and uploads only
blobs the store lacks; a restore rewrites only the files whose content differs.

The filesystem work is synchronous and runs in a thread; the store is awaited
between. The caller keeps the task's tools from running meanwhile (the
tool-runner holds the task's lock and has reaped its processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import zstandard

from holdfast_shared.ids import new_id
from holdfast_shared.workspace_archive.manifest import MODE_MASK, Entry, Manifest
from holdfast_shared.workspace_archive.stores import ArchiveStore

# Top-level names that are the runner's, not the task's: ext4's lost+found and
# the mount point of a call's skills (skills.MOUNT_DIR).
EXCLUDED = frozenset({"lost+found", ".skills"})
# Blobs travel to and from the store in batches of about this many bytes / files.
BATCH_BYTES = 8 * 1024 * 1024
BATCH_FILES = 1000
_CHUNK = 1024 * 1024
_ZSTD_LEVEL = 3


class ArchiveError(RuntimeError):
    """A checkpoint or restore that could not be completed; the message says why."""


@dataclass(frozen=True)
class CheckpointResult:
    archive_id: str
    manifest: Manifest
    # False when nothing changed since ``previous_id``, which is then returned.
    created: bool
    files_read: int
    bytes_read: int
    blobs_stored: int
    bytes_stored: int


@dataclass(frozen=True)
class RestoreResult:
    files_written: int
    bytes_written: int


async def checkpoint(
    store: ArchiveStore,
    tenant_id: str,
    task_id: str,
    root: Path,
    *,
    previous: Manifest | None = None,
    previous_id: str | None = None,
    reason: str = "checkpoint",
) -> CheckpointResult:
    """Archive ``root`` and make the archive the task's head.

    With ``previous`` (the manifest ``previous_id`` holds, as written or
    restored on this disk) only new or changed files are read; if nothing
    changed at all, ``previous_id`` is returned and nothing is written.
    """
    entries, unknown = await asyncio.to_thread(_scan, root, previous)
    bytes_read = 0
    if unknown:
        hashed = await asyncio.to_thread(_hash_files, root, unknown)
        for path, (digest, size, mtime_ns, mode) in hashed.items():
            entries[path] = Entry("file", mode=mode, size=size, mtime_ns=mtime_ns, sha256=digest)
            bytes_read += size
    manifest = Manifest(entries)
    if previous is not None and previous_id is not None and manifest == previous:
        return CheckpointResult(previous_id, previous, False, len(unknown), bytes_read, 0, 0)
    by_hash: dict[str, list[str]] = {}
    for path, entry in entries.items():
        if entry.kind == "file":
            by_hash.setdefault(entry.sha256, []).append(path)
    missing = await store.missing(tenant_id, by_hash)
    stored = stored_bytes = 0
    for batch in _batches(sorted(missing), {h: entries[by_hash[h][0]].size for h in missing}):
        blobs = await asyncio.to_thread(_read_blobs, root, batch, by_hash)
        await store.put_blobs(tenant_id, blobs)
        stored += len(blobs)
        stored_bytes += sum(len(data) for _size, data in blobs.values())
    archive_id = new_id("wsa")
    await store.put_archive(tenant_id, task_id, archive_id, manifest, reason)
    return CheckpointResult(
        archive_id, manifest, True, len(unknown), bytes_read, stored, stored_bytes
    )


async def restore(
    store: ArchiveStore,
    tenant_id: str,
    root: Path,
    manifest: Manifest,
    *,
    previous: Manifest | None = None,
) -> RestoreResult:
    """Make the tree under ``root`` exactly ``manifest``: what is not in it is
    removed, what differs is rewritten. ``previous``: the manifest this disk last
    wrote or restored for ``root`` (files still matching it and the target are kept).
    ArchiveError if a blob is missing; the tree is then incomplete (restore again).
    """
    to_write = await asyncio.to_thread(_prepare, root, manifest, previous)
    wanted = {manifest.entries[p].sha256 for p in to_write}
    paths: dict[str, list[str]] = {}
    for path in to_write:
        paths.setdefault(manifest.entries[path].sha256, []).append(path)
    sizes = {digest: manifest.entries[group[0]].size for digest, group in paths.items()}
    written = written_bytes = 0
    batches = list(_batches(sorted(wanted), sizes))
    # The next batch is fetched while this one is written.
    fetching = asyncio.ensure_future(store.get_blobs(tenant_id, batches[0])) if batches else None
    try:
        for number, batch in enumerate(batches):
            assert fetching is not None
            blobs = await fetching
            fetching = None
            if number + 1 < len(batches):
                fetching = asyncio.ensure_future(store.get_blobs(tenant_id, batches[number + 1]))
            lost = set(batch) - set(blobs)
            if lost:
                raise ArchiveError(f"{len(lost)} blob(s) of the archive are missing from the store")
            files = [(path, digest) for digest in batch for path in paths[digest]]
            written_bytes += await asyncio.to_thread(_write_files, root, manifest, files, blobs)
            written += len(files)
    finally:
        if fetching is not None:
            fetching.cancel()
            await asyncio.gather(fetching, return_exceptions=True)
    await asyncio.to_thread(_finish, root, manifest)
    return RestoreResult(written, written_bytes)


# -- checkpoint, in a thread -------------------------------------------------------


def _kind(mode: int) -> str | None:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "link"
    return None  # fifos, sockets, devices: not archived


def _walk(root: Path) -> Iterable[tuple[str, str, os.stat_result]]:
    """(relative path, absolute path, lstat) of everything under ``root``, parents first."""
    stack = [("", str(root))]
    while stack:
        rel_dir, abs_dir = stack.pop()
        try:
            listing = list(os.scandir(abs_dir))
        except FileNotFoundError:
            continue
        for entry in listing:
            if not rel_dir and entry.name in EXCLUDED:
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield rel, entry.path, st
            if stat.S_ISDIR(st.st_mode):
                stack.append((rel, entry.path))


def _scan(root: Path, previous: Manifest | None) -> tuple[dict[str, Entry], list[str]]:
    entries: dict[str, Entry] = {}
    unknown: list[str] = []
    known = previous.entries if previous is not None else {}
    for rel, path, st in _walk(root):
        kind = _kind(st.st_mode)
        mode = st.st_mode & MODE_MASK
        if kind == "dir":
            entries[rel] = Entry("dir", mode=mode)
        elif kind == "link":
            with contextlib.suppress(FileNotFoundError):
                entries[rel] = Entry("link", target=os.readlink(path))
        elif kind == "file":
            before = known.get(rel)
            if (
                before is not None
                and before.kind == "file"
                and before.size == st.st_size
                and before.mtime_ns == st.st_mtime_ns
            ):
                # A chmod does not touch the mtime: the mode is always today's.
                entries[rel] = Entry(
                    "file",
                    mode=mode,
                    size=st.st_size,
                    mtime_ns=st.st_mtime_ns,
                    sha256=before.sha256,
                )
            else:
                unknown.append(rel)
    return entries, unknown


def _hash_files(root: Path, paths: list[str]) -> dict[str, tuple[str, int, int, int]]:
    """path → (sha256, size, mtime_ns, mode) for those still there."""
    out: dict[str, tuple[str, int, int, int]] = {}
    for rel in paths:
        try:
            fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, OSError):
            continue  # gone, or replaced by a symlink since the scan: the next one sees it
        with os.fdopen(fd, "rb") as file:
            # The mtime before reading: a write meanwhile leaves a newer one, so the
            # next checkpoint reads the file again.
            st = os.fstat(file.fileno())
            digest = hashlib.sha256()
            size = 0
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
        out[rel] = (digest.hexdigest(), size, st.st_mtime_ns, st.st_mode & MODE_MASK)
    return out


def _batches(hashes: list[str], sizes: dict[str, int]) -> Iterable[list[str]]:
    batch: list[str] = []
    total = 0
    for digest in hashes:
        batch.append(digest)
        total += sizes.get(digest, 0)
        if total >= BATCH_BYTES or len(batch) >= BATCH_FILES:
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


def _read_blobs(
    root: Path, hashes: list[str], by_hash: dict[str, list[str]]
) -> dict[str, tuple[int, bytes]]:
    compressor = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    blobs: dict[str, tuple[int, bytes]] = {}
    for digest in hashes:
        for rel in by_hash[digest]:
            try:
                fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as file:
                data = file.read()
            if hashlib.sha256(data).hexdigest() == digest:
                blobs[digest] = (len(data), compressor.compress(data))
                break
        else:
            # Every file with this content changed since it was hashed: the
            # manifest would name a blob that is not stored.
            raise ArchiveError("files changed while the workspace was being archived")
    return blobs


# -- restore, in a thread ----------------------------------------------------------


def _remove(path: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # never follows symlinks
    else:
        os.unlink(path)


def _prepare(root: Path, target: Manifest, previous: Manifest | None) -> list[str]:
    """Remove what does not belong, make directories and symlinks; the files to write."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    known = previous.entries if previous is not None else {}
    kept: set[str] = set()
    # A directory removed here is not descended into (_walk finds it gone).
    for rel, path, st in _walk(root):
        want = target.entries.get(rel)
        kind = _kind(st.st_mode)
        if want is not None and want.kind == kind:
            if kind == "dir":
                kept.add(rel)
                continue
            if kind == "link" and os.readlink(path) == want.target:
                kept.add(rel)
                continue
            before = known.get(rel)
            if (
                kind == "file"
                and before is not None
                and before.kind == "file"
                and (before.size, before.mtime_ns) == (st.st_size, st.st_mtime_ns)
                and before.sha256 == want.sha256
            ):
                kept.add(rel)
                continue
        _remove(path, st)
    to_write = []
    # Sorted, so a directory comes before what is in it; Manifest.load made sure
    # every parent is a directory entry, so nothing is created through a symlink.
    for rel in sorted(target.entries):
        entry = target.entries[rel]
        if rel in kept:
            continue
        where = root / rel
        if entry.kind == "dir":
            os.mkdir(where, 0o700)
        elif entry.kind == "link":
            os.symlink(entry.target, where)
        else:
            to_write.append(rel)
    return to_write


def _write_files(
    root: Path, manifest: Manifest, files: list[tuple[str, str]], blobs: dict[str, bytes]
) -> int:
    decompressor = zstandard.ZstdDecompressor()
    contents: dict[str, bytes] = {}
    total = 0
    for rel, digest in files:
        data = contents.get(digest)
        if data is None:
            data = contents[digest] = decompressor.decompress(blobs[digest])
            if hashlib.sha256(data).hexdigest() != digest:
                raise ArchiveError(f"the stored blob {digest} does not match its hash")
        # O_EXCL | O_NOFOLLOW: never writes through a link that appeared meanwhile.
        fd = os.open(
            root / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        total += len(data)
    return total


def _finish(root: Path, manifest: Manifest) -> None:
    """Modes and mtimes last: a read-only directory had to be writable until now."""
    for rel in sorted(manifest.entries, reverse=True):
        entry = manifest.entries[rel]
        target = root / rel
        if entry.kind == "file":
            os.chmod(target, entry.mode)
            os.utime(target, ns=(entry.mtime_ns, entry.mtime_ns), follow_symlinks=False)
        elif entry.kind == "dir":
            os.chmod(target, entry.mode)
