"""Checkpoint a workspace directory into an archive store, and restore one.

Incremental both ways, against the manifest this disk last wrote or restored
(``previous``): a file whose size and mtime match its entry there is taken to be
unchanged and not read again (the same trust ``rsync`` and ``make`` put in
mtimes; a restore sets every file's mtime, so a restored tree matches its
manifest). A checkpoint reads and hashes only the other files and uploads only
blobs the store lacks; a restore rewrites only the files whose content differs.

The filesystem work is synchronous and runs in a thread; the store is awaited
between. The caller keeps the task's tools from running meanwhile (the
tool-runner holds the task's lock, has frozen the task's processes for a
checkpoint and reaped them for a restore).

Nothing outside ``root`` is read or written, even while a process of the task
swaps a directory for a symlink (to ``/``, another tenant's workspace, the data
dir) as we go: no path below ``root`` is ever resolved by the kernel in one
piece. Every directory is opened from its parent's fd with ``O_NOFOLLOW |
O_DIRECTORY``, listed with ``scandir(fd)`` and stat'ed with ``fstatat``; files
are opened, created (``O_EXCL``), linked, unlinked and chmod'ed relative to
such an fd, never through a symlink. A directory that became a symlink since
it was listed is not entered by a checkpoint (the next one records the link)
and makes a restore fail with ArchiveError; a symlink's own entry is removed,
never what it points to.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import zstandard
from holdfast_shared.ids import new_id
from holdfast_shared.workspace_checkpoints.manifest import MODE_MASK, Entry, Manifest
from holdfast_shared.workspace_checkpoints.stores import ArchiveStore

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


# -- paths under the root, opened without following a symlink -------------------------

# A directory to list (scandir) or to create, remove and open things in.
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A directory only passed on as ``dir_fd``: needs no read permission, only search.
_DIR_PATH = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a fifo that took a file's place since the scan must not hang the read.
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# What openat answers for a name that is no longer a directory: a symlink (ELOOP
# under O_NOFOLLOW) or anything else (ENOTDIR).
_REPLACED = (errno.ELOOP, errno.ENOTDIR)


def _open_root(root: Path) -> int | None:
    """The workspace's own directory (the runner's path, not the task's); None if absent."""
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


def _split(rel: str) -> tuple[str, str]:
    parent, _, name = rel.rpartition("/")
    return parent, name


class _Dirs:
    """Directories under the root by relative path, each opened from its parent's
    fd with O_NOFOLLOW: a component that is a symlink (or no directory) now raises
    OSError (ELOOP / ENOTDIR) instead of being followed. The last chain opened is
    kept for the next path, so callers going through paths in sorted order open
    each directory about once."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self._chain: list[tuple[str, int]] = []  # (name, fd) from the root down

    def fd(self, rel_dir: str) -> int:
        parts = rel_dir.split("/") if rel_dir else []
        keep = 0
        while keep < min(len(parts), len(self._chain)) and self._chain[keep][0] == parts[keep]:
            keep += 1
        for _name, fd in reversed(self._chain[keep:]):
            os.close(fd)
        del self._chain[keep:]
        for name in parts[keep:]:
            parent = self._chain[-1][1] if self._chain else self.root_fd
            self._chain.append((name, os.open(name, _DIR_PATH, dir_fd=parent)))
        return self._chain[-1][1] if self._chain else self.root_fd

    def close(self) -> None:
        for _name, fd in reversed(self._chain):
            os.close(fd)
        self._chain.clear()


@contextlib.contextmanager
def _opened(root: Path, *, create: bool = False) -> Iterator[_Dirs | None]:
    if create:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    root_fd = _open_root(root)
    if root_fd is None:
        yield None
        return
    dirs = _Dirs(root_fd)
    try:
        yield dirs
    finally:
        dirs.close()
        os.close(root_fd)


def _restoring_in(dirs: _Dirs, rel: str) -> tuple[int, str]:
    """(fd of ``rel``'s directory, its name) for a restore: ArchiveError if a
    directory on the way was replaced by a symlink or a file."""
    parent, name = _split(rel)
    try:
        return dirs.fd(parent), name
    except OSError as exc:
        if exc.errno in _REPLACED:
            raise ArchiveError(
                f"{parent!r} of the workspace stopped being a directory during the restore"
            ) from exc
        raise


def _listing(fd: int) -> list[os.DirEntry[str]]:
    # scandir on an fd: its entries' stat() is fstatat(fd, name), never a path.
    with os.scandir(fd) as found:
        return list(found)


Visit = Callable[[str, int, str, os.stat_result], bool]


def _walk(root_fd: int, visit: Visit) -> None:
    """``visit(relative path, fd of its directory, name, lstat)`` for everything
    under the root, parents first; a directory is entered, through an fd opened
    from its parent's with O_NOFOLLOW, if ``visit`` returns True. A directory
    replaced by a symlink since it was listed is then not entered: nothing
    outside the root is ever listed. At most one fd per level is open."""
    stack: list[tuple[str, int, list[os.DirEntry[str]]]] = [("", root_fd, _listing(root_fd))]
    try:
        while stack:
            rel_dir, fd, entries = stack[-1]
            if not entries:
                stack.pop()
                if fd != root_fd:
                    os.close(fd)
                continue
            entry = entries.pop()
            if not rel_dir and entry.name in EXCLUDED:
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not visit(rel, fd, entry.name, st) or not stat.S_ISDIR(st.st_mode):
                continue
            try:
                child = os.open(entry.name, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (*_REPLACED, errno.ENOENT):
                    continue  # replaced or gone since it was listed
                raise
            try:
                stack.append((rel, child, _listing(child)))
            except BaseException:
                os.close(child)
                raise
    finally:
        for _rel, fd, _entries in stack:
            if fd != root_fd:
                os.close(fd)


# -- checkpoint, in a thread -------------------------------------------------------


def _kind(mode: int) -> str | None:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "link"
    return None  # fifos, sockets, devices: not archived


def _scan(root: Path, previous: Manifest | None) -> tuple[dict[str, Entry], list[str]]:
    entries: dict[str, Entry] = {}
    unknown: list[str] = []
    known = previous.entries if previous is not None else {}

    def visit(rel: str, fd: int, name: str, st: os.stat_result) -> bool:
        kind = _kind(st.st_mode)
        mode = st.st_mode & MODE_MASK
        if kind == "dir":
            entries[rel] = Entry("dir", mode=mode)
        elif kind == "link":
            with contextlib.suppress(OSError):  # gone, or no longer a link
                entries[rel] = Entry("link", target=os.readlink(name, dir_fd=fd))
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
        return True

    with _opened(root) as dirs:
        if dirs is not None:
            _walk(dirs.root_fd, visit)
    return entries, unknown


def _open_file(dirs: _Dirs, rel: str) -> int | None:
    """A read fd of the regular file at ``rel``, reached without following any
    symlink; None if it is gone or no longer a regular file under directories."""
    parent, name = _split(rel)
    try:
        fd = os.open(name, _READ, dir_fd=dirs.fd(parent))
    except OSError:
        return None  # gone, or it or a directory above replaced since the scan
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _hash_files(root: Path, paths: list[str]) -> dict[str, tuple[str, int, int, int]]:
    """path → (sha256, size, mtime_ns, mode) for those still there."""
    out: dict[str, tuple[str, int, int, int]] = {}
    with _opened(root) as dirs:
        if dirs is None:
            return out
        for rel in sorted(paths):
            fd = _open_file(dirs, rel)
            if fd is None:
                continue  # the next checkpoint sees what is there now
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
    with _opened(root) as dirs:
        for digest in hashes:
            for rel in by_hash[digest]:
                fd = _open_file(dirs, rel) if dirs is not None else None
                if fd is None:
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


def _rmtree_at(parent_fd: int, name: str) -> None:
    """Remove the directory ``name`` of ``parent_fd`` and everything in it, entering
    each directory through an fd opened with O_NOFOLLOW from its parent's: a
    directory swapped for a symlink meanwhile loses the link, never what it
    points to. Iterative: no recursion limit on deep trees."""
    try:
        top = os.open(name, _DIR, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return
        if exc.errno in _REPLACED:
            os.unlink(name, dir_fd=parent_fd)  # the link (or file) itself
            return
        raise
    # (fd, its entries left, its name, its parent's fd)
    stack: list[tuple[int, list[os.DirEntry[str]], str, int]] = []
    try:
        # A read-only directory's entries could not be unlinked.
        os.fchmod(top, 0o700)
        stack.append((top, _listing(top), name, parent_fd))
    except BaseException:
        os.close(top)
        raise
    try:
        while stack:
            fd, entries, own_name, own_parent = stack[-1]
            if not entries:
                stack.pop()
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(own_name, dir_fd=own_parent)
                continue
            entry = entries.pop()
            try:
                child = os.open(entry.name, _DIR, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (*_REPLACED, errno.ENOENT):
                    raise
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=fd)
                continue
            try:
                os.fchmod(child, 0o700)
                stack.append((child, _listing(child), entry.name, fd))
            except BaseException:
                os.close(child)
                raise
    finally:
        for fd, _entries, _name, _parent in stack:
            os.close(fd)


def _remove_at(dir_fd: int, name: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        _rmtree_at(dir_fd, name)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def _prepare(root: Path, target: Manifest, previous: Manifest | None) -> list[str]:
    """Remove what does not belong, make directories and symlinks; the files to write."""
    known = previous.entries if previous is not None else {}
    kept: set[str] = set()

    def visit(rel: str, fd: int, name: str, st: os.stat_result) -> bool:
        want = target.entries.get(rel)
        kind = _kind(st.st_mode)
        if want is not None and want.kind == kind:
            if kind == "dir":
                kept.add(rel)
                return True
            if kind == "link" and os.readlink(name, dir_fd=fd) == want.target:
                kept.add(rel)
                return False
            before = known.get(rel)
            if (
                kind == "file"
                and before is not None
                and before.kind == "file"
                and (before.size, before.mtime_ns) == (st.st_size, st.st_mtime_ns)
                and before.sha256 == want.sha256
            ):
                kept.add(rel)
                return False
        _remove_at(fd, name, st)
        return False  # removed: not entered

    to_write = []
    with _opened(root, create=True) as dirs:
        if dirs is None:
            raise ArchiveError(f"the workspace directory {root} vanished")
        _walk(dirs.root_fd, visit)
        # Sorted, so a directory comes before what is in it; Manifest.load made sure
        # every parent is a directory entry, and each is opened without following a
        # symlink, so nothing is created through one.
        for rel in sorted(target.entries):
            entry = target.entries[rel]
            if rel in kept:
                continue
            if entry.kind == "file":
                to_write.append(rel)
                continue
            at, name = _restoring_in(dirs, rel)
            if entry.kind == "dir":
                os.mkdir(name, 0o700, dir_fd=at)
            else:
                os.symlink(entry.target, name, dir_fd=at)
    return to_write


def _write_files(
    root: Path, manifest: Manifest, files: list[tuple[str, str]], blobs: dict[str, bytes]
) -> int:
    decompressor = zstandard.ZstdDecompressor()
    contents: dict[str, bytes] = {}
    total = 0
    with _opened(root) as dirs:
        if dirs is None:
            raise ArchiveError(f"the workspace directory {root} vanished during the restore")
        for rel, digest in sorted(files):
            data = contents.get(digest)
            if data is None:
                data = contents[digest] = decompressor.decompress(blobs[digest])
                if hashlib.sha256(data).hexdigest() != digest:
                    raise ArchiveError(f"the stored blob {digest} does not match its hash")
            at, name = _restoring_in(dirs, rel)
            # O_EXCL | O_NOFOLLOW: never writes through a link that appeared meanwhile.
            fd = os.open(name, _WRITE, 0o600, dir_fd=at)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            total += len(data)
    return total


def _set_at(dir_fd: int, name: str, entry: Entry) -> None:
    """The entry's mode (and a file's mtime) on ``name`` itself, never on what a
    symlink there would point to: ArchiveError if it is no longer that kind."""
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags | os.O_DIRECTORY if entry.kind == "dir" else flags, dir_fd=dir_fd)
    try:
        if _kind(os.fstat(fd).st_mode) != entry.kind:
            raise ArchiveError(f"{name!r} of the workspace changed kind during the restore")
        # An O_PATH fd takes no fchmod; its /proc link reaches exactly its inode
        # (Python 3.11 has no fchmodat without following).
        at = f"/proc/self/fd/{fd}"
        try:
            os.chmod(at, entry.mode)
        except FileNotFoundError:
            _set_without_proc(dir_fd, name, entry)
            return
        if entry.kind == "file":
            os.utime(at, ns=(entry.mtime_ns, entry.mtime_ns))
    finally:
        os.close(fd)


def _set_without_proc(dir_fd: int, name: str, entry: Entry) -> None:
    """No /proc mounted: an fd that can be fchmod'ed (needs read permission for
    whoever is not root, which the restore's own files and directories have)."""
    flags = _READ | (os.O_DIRECTORY if entry.kind == "dir" else 0)
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        if _kind(os.fstat(fd).st_mode) != entry.kind:
            raise ArchiveError(f"{name!r} of the workspace changed kind during the restore")
        os.fchmod(fd, entry.mode)
        if entry.kind == "file":
            os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
    finally:
        os.close(fd)


def _finish(root: Path, manifest: Manifest) -> None:
    """Modes and mtimes last: a read-only directory had to be writable until now."""
    with _opened(root) as dirs:
        if dirs is None:
            raise ArchiveError(f"the workspace directory {root} vanished during the restore")
        for rel in sorted(manifest.entries, reverse=True):
            entry = manifest.entries[rel]
            if entry.kind == "link":
                continue
            at, name = _restoring_in(dirs, rel)
            try:
                _set_at(at, name, entry)
            except OSError as exc:
                if exc.errno in _REPLACED:
                    raise ArchiveError(
                        f"{rel!r} of the workspace changed kind during the restore"
                    ) from exc
                raise
