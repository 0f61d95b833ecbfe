"""Answer the gateway's requests about a task's files (``/tasks/{id}/files``).

Consumes: :class:`~holdfast_shared.jobs.WorkspaceFiles` jobs on ``Keys.tools``
(``consumer.py`` hands them here), and for a write the upload's bytes at its
``upload_key``. Produces: a :class:`~holdfast_shared.jobs.WorkspaceFilesReply` on
the job's ``reply_to`` list.

Guarantees:
* Nothing outside the workspace is read, written or listed, whatever the task's
  processes did to it: every path is walked from the workspace's own directory
  one component at a time, each opened from its parent's fd with ``O_NOFOLLOW``
  (``workspace_tree``'s ``_Dirs``). A symlink is listed as a link and never
  followed: a path through one is not found.
* A workspace not on this disk (hibernated, or held by another runner) is
  restored from its head first, as for a tool call (``checkpoints.in_use``); the
  request holds the task's lock shared, so it runs beside the task's tool calls.
* A write replaces the file whole (written beside it, then renamed over it), and
  a write or delete is archived at once (a checkpoint), so every runner sees it
  and a lost disk does not lose it.
* A read of an archive (``archive_id``: a checkpoint's files) comes from the
  store, never from a disk.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import errno
import hashlib
import logging
import os
import secrets
import stat
from pathlib import Path

import zstandard
from holdfast_shared.jobs import WorkspaceFile, WorkspaceFiles, WorkspaceFilesReply
from holdfast_shared.workspace_checkpoints import Entry, ManifestError
from holdfast_shared.workspace_checkpoints.manifest import check_path

from holdfast_tool_runner.checkpoints import WorkspaceCheckpoints
from holdfast_tool_runner.workspace_tree import (
    _DIR,
    _READ,
    EXCLUDED,
    _Dirs,
    _hash_files,
    _kind,
    _opened,
    _remove_at,
    _split,
    _walk,
)
from holdfast_tool_runner.workspaces import WorkspaceError

log = logging.getLogger(__name__)

_REPLY_TTL_SECONDS = 120
# The most one read answers (the gateway asks chunk by chunk).
MAX_READ_BYTES = 4 * 1024 * 1024
# Where a tool's files are the agent's outputs (an ``artifact`` event each).
OUTPUTS_DIR = "outputs"
# The most artifacts one call reports.
MAX_ARTIFACTS = 100
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _Problem(Exception):
    """A request that cannot be carried out as asked; ``problem`` says which way."""

    def __init__(self, problem: str, message: str) -> None:
        super().__init__(message)
        self.problem = problem


class WorkspaceFilesHandler:
    """Carries out :class:`WorkspaceFiles` requests on this runner's workspaces."""

    def __init__(self, archiving: WorkspaceCheckpoints) -> None:
        self.archiving = archiving
        # The blob of the last archived file read: a download asks for it chunk by chunk.
        self._last_blob: tuple[str, bytes] | None = None

    async def handle(self, request: WorkspaceFiles) -> WorkspaceFilesReply:
        """Carry out ``request`` and answer it on its ``reply_to``."""
        try:
            reply = await self._carry_out(request)
        except _Problem as exc:
            reply = WorkspaceFilesReply.model_validate({"error": str(exc), "problem": exc.problem})
        except (WorkspaceError, ManifestError) as exc:
            reply = WorkspaceFilesReply(error=str(exc))
        except Exception as exc:
            log.exception("workspace files %s of task %s failed", request.action, request.task_id)
            reply = WorkspaceFilesReply(error=f"the tool-runner failed: {type(exc).__name__}")
        redis = self.archiving.redis
        async with redis.pipeline(transaction=True) as pipe:
            pipe.rpush(request.reply_to, reply.model_dump_json())
            pipe.expire(request.reply_to, _REPLY_TTL_SECONDS)
            await pipe.execute()
        return reply

    async def _carry_out(self, request: WorkspaceFiles) -> WorkspaceFilesReply:
        path = _checked(request.path, allow_root=request.action == "list")
        if request.archive_id is not None:
            return await self._read_archived(request, path)
        tenant_id, task_id = request.tenant_id, request.task_id
        if request.action == "copy":
            return await self._copy(request, path)
        data: bytes | None = None
        if request.action == "write":
            data = await self._take_upload(request)
            if len(data) > self.archiving.workspaces.max_bytes:
                raise _Problem("full", "the file is larger than the workspace")
        elif not await self._has_workspace(tenant_id, task_id):
            # Never used: nothing to make (a list of it is empty).
            if request.action == "list" and not path:
                return WorkspaceFilesReply()
            raise _Problem("not_found", f"{path!r} is not in the workspace")
        written: list[WorkspaceFile] = []
        async with self.archiving.in_use(tenant_id, task_id) as root:
            match request.action:
                case "list":
                    state = await asyncio.to_thread(self.archiving.read_state, tenant_id, task_id)
                    known = state[1].entries if state else {}
                    entries = await asyncio.to_thread(_list, root, path, request.recursive, known)
                    return WorkspaceFilesReply(entries=entries)
                case "read":
                    found, chunk = await asyncio.to_thread(_read, root, path, request)
                    return WorkspaceFilesReply(
                        entries=[found], data=base64.b64encode(chunk).decode()
                    )
                case "write":
                    assert data is not None
                    written.append(await asyncio.to_thread(_write, root, path, data))
                case "delete":
                    await asyncio.to_thread(_delete, root, path)
        await self._archive(tenant_id, task_id)
        return WorkspaceFilesReply(entries=written)

    async def _copy(self, request: WorkspaceFiles, path: str) -> WorkspaceFilesReply:
        """Copy ``path`` of ``from_task_id``'s workspace into the task's, at the same
        path: read whole first (under the source's lock), then written (under the
        target's), never both held at once."""
        tenant_id, source = request.tenant_id, request.from_task_id
        if source is None:
            raise _Problem("invalid_path", "a copy names no task to copy from")
        if not await self._has_workspace(tenant_id, source):
            raise _Problem("not_found", f"{path!r} is not in the workspace")
        limit = self.archiving.workspaces.max_bytes
        async with self.archiving.in_use(tenant_id, source) as root:
            files = await asyncio.to_thread(_gather, root, path, limit)
        written: list[WorkspaceFile] = []
        async with self.archiving.in_use(tenant_id, request.task_id) as root:
            for rel, data in files:
                written.append(await asyncio.to_thread(_write, root, rel, data))
        await self._archive(tenant_id, request.task_id)
        return WorkspaceFilesReply(entries=written)

    async def _has_workspace(self, tenant_id: str, task_id: str) -> bool:
        if await asyncio.to_thread(self.archiving.workspaces.exists, tenant_id, task_id):
            return True
        return await self.archiving.store.head(tenant_id, task_id) is not None

    async def _take_upload(self, request: WorkspaceFiles) -> bytes:
        if request.upload_key is None:
            raise _Problem("invalid_path", "a write names no upload")
        redis = self.archiving.redis
        async with redis.pipeline(transaction=True) as pipe:
            pipe.get(request.upload_key)
            pipe.delete(request.upload_key)
            encoded, _deleted = await pipe.execute()
        if encoded is None:
            raise _Problem("not_found", "the upload expired before a tool-runner took it")
        try:
            return base64.b64decode(encoded, validate=True)
        except binascii.Error:
            raise _Problem("invalid_path", "the upload is not base64") from None

    async def _archive(self, tenant_id: str, task_id: str) -> None:
        """Archive a change made here now, so the next call on any runner sees it."""
        try:
            async with self.archiving.exclusive(tenant_id, task_id):
                await self.archiving.checkpoint_locked(tenant_id, task_id, "files")
        except Exception:
            # Still on this disk: the turn end or hibernation archives it later.
            log.warning("could not archive the files of task %s", task_id, exc_info=True)

    async def _read_archived(self, request: WorkspaceFiles, path: str) -> WorkspaceFilesReply:
        if request.action != "read" or request.archive_id is None:
            raise _Problem("invalid_path", "only a read takes an archive")
        store = self.archiving.store
        manifest = await store.manifest(request.tenant_id, request.task_id, request.archive_id)
        if manifest is None:
            raise _Problem("not_found", f"the task has no archive {request.archive_id!r}")
        found = manifest.entries.get(path)
        if found is None or found.kind != "file":
            problem = "not_a_file" if found is not None and found.kind == "dir" else "not_found"
            raise _Problem(problem, f"{path!r} is not a file of the archive")
        if self._last_blob is None or self._last_blob[0] != found.sha256:
            blobs = await store.get_blobs(request.tenant_id, [found.sha256])
            if found.sha256 not in blobs:
                raise _Problem("not_found", f"the content of {path!r} is missing from the store")
            data = await asyncio.to_thread(
                zstandard.ZstdDecompressor().decompress, blobs[found.sha256]
            )
            self._last_blob = (found.sha256, data)
        data = self._last_blob[1]
        chunk = data[request.offset : request.offset + min(request.length, MAX_READ_BYTES)]
        return WorkspaceFilesReply(
            entries=[_entry_of(path, found)], data=base64.b64encode(chunk).decode()
        )


def _checked(path: str, *, allow_root: bool) -> str:
    if not path:
        if allow_root:
            return ""
        raise _Problem("invalid_path", "the workspace itself is not a file")
    try:
        check_path(path)
    except ManifestError as exc:
        raise _Problem("invalid_path", str(exc)) from None
    if path.split("/", 1)[0] in EXCLUDED:
        raise _Problem("not_found", f"{path!r} is not in the workspace")
    return path


def _entry_of(path: str, entry: Entry) -> WorkspaceFile:
    return WorkspaceFile(
        path=path, kind=entry.kind, size=entry.size, sha256=entry.sha256, mtime_ns=entry.mtime_ns
    )


def _missing(path: str, exc: OSError) -> _Problem:
    if exc.errno == errno.ELOOP:
        return _Problem("not_found", f"{path!r} goes through a symbolic link")
    if exc.errno == errno.ENAMETOOLONG:
        return _Problem("not_found", f"{path!r} has a name longer than a file can have")
    if exc.errno == errno.ENOTDIR:
        return _Problem("not_found", f"{path!r} goes through a file")
    return _Problem("not_found", f"{path!r} is not in the workspace")


def _parent(dirs: _Dirs, path: str) -> tuple[int, str]:
    """(fd of ``path``'s directory, its name), reached without following a symlink."""
    parent, name = _split(path)
    try:
        return dirs.fd(parent), name
    except OSError as exc:
        raise _missing(path, exc) from None


# -- in a thread -----------------------------------------------------------------------


def _list(root: Path, path: str, recursive: bool, known: dict[str, Entry]) -> list[WorkspaceFile]:
    """The entries of the directory ``path`` (all below it if ``recursive``); a
    file's hash is taken from ``known`` (the last archive's manifest) when its size
    and mtime still match, else read."""
    listed = _stat_tree(root, path, recursive)
    unknown = [
        rel
        for rel, st in listed.items()
        if stat.S_ISREG(st.st_mode) and not _matches(known.get(rel), st.st_size, st.st_mtime_ns)
    ]
    hashed = _hash_files(root, unknown) if unknown else {}
    entries = []
    for rel, st in sorted(listed.items()):
        kind = _kind(st.st_mode)
        if kind == "file":
            before = known.get(rel)
            if before is not None and _matches(before, st.st_size, st.st_mtime_ns):
                digest: str | None = before.sha256
            elif rel in hashed:
                digest = hashed[rel][0]
            else:
                continue  # gone since it was listed
            entries.append(
                WorkspaceFile(
                    path=rel, kind="file", size=st.st_size, sha256=digest, mtime_ns=st.st_mtime_ns
                )
            )
        elif kind in ("dir", "link"):
            entries.append(WorkspaceFile(path=rel, kind=kind, mtime_ns=st.st_mtime_ns))
    return entries


def _stat_tree(root: Path, path: str, recursive: bool) -> dict[str, os.stat_result]:
    """The lstat of each entry of the directory ``path`` (all below it if ``recursive``)."""
    listed: dict[str, os.stat_result] = {}
    with _opened(root) as dirs:
        if dirs is None:
            return listed
        if path:
            at, name = _parent(dirs, path)
            try:
                top = os.open(name, _DIR, dir_fd=at)
            except OSError as exc:
                # O_NOFOLLOW | O_DIRECTORY answers ENOTDIR for a symlink as for a file.
                if exc.errno == errno.ENOTDIR and not _is_link(at, name):
                    raise _Problem("not_a_directory", f"{path!r} is not a directory") from None
                raise _missing(path, exc) from None
        else:
            top = dirs.root_fd

        def visit(rel: str, _fd: int, _name: str, st: os.stat_result) -> bool:
            if _kind(st.st_mode) is None:
                return False  # fifos, sockets, devices: not the task's files
            listed[f"{path}/{rel}" if path else rel] = st
            return recursive

        try:
            _walk(top, visit)
        finally:
            if top != dirs.root_fd:
                os.close(top)
    return listed


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def outputs_state(root: Path) -> dict[str, Entry]:
    """The size and mtime of each file under ``outputs/`` (not hashed), to tell
    after a call what it wrote there. Blocking."""
    try:
        listed = _stat_tree(root, OUTPUTS_DIR, True)
    except _Problem:
        return {}
    return {
        rel: Entry("file", size=st.st_size, mtime_ns=st.st_mtime_ns)
        for rel, st in listed.items()
        if stat.S_ISREG(st.st_mode)
    }


def outputs_written(root: Path, before: dict[str, Entry]) -> list[WorkspaceFile]:
    """The files under ``outputs/`` new or changed since ``before`` (``outputs_state``
    at a call's start), hashed, at most ``MAX_ARTIFACTS``: what the call published.
    Blocking."""
    try:
        found = _list(root, OUTPUTS_DIR, True, before)
    except _Problem:
        return []  # no outputs/ (or not a directory): nothing published
    written = [
        entry
        for entry in found
        if entry.kind == "file" and not _matches(before.get(entry.path), entry.size, entry.mtime_ns)
    ]
    return written[:MAX_ARTIFACTS]


def _matches(entry: Entry | None, size: int, mtime_ns: int) -> bool:
    return (
        entry is not None
        and entry.kind == "file"
        and (entry.size, entry.mtime_ns) == (size, mtime_ns)
    )


def _open_regular(dirs: _Dirs, path: str) -> int:
    at, name = _parent(dirs, path)
    try:
        fd = os.open(name, _READ, dir_fd=at)
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise _Problem("not_a_file", f"{path!r} is a directory") from None
        raise _missing(path, exc) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise _Problem("not_a_file", f"{path!r} is a directory")
        raise _Problem("not_found", f"{path!r} is not a regular file")
    return fd


def _read(root: Path, path: str, request: WorkspaceFiles) -> tuple[WorkspaceFile, bytes]:
    """The file's entry (with its hash when the read starts at 0, which reads it
    whole) and ``request.length`` bytes of it from ``request.offset``."""
    with _opened(root) as dirs:
        if dirs is None:
            raise _Problem("not_found", f"{path!r} is not in the workspace")
        fd = _open_regular(dirs, path)
        with os.fdopen(fd, "rb") as file:
            st = os.fstat(file.fileno())
            if (request.expect_size, request.expect_mtime_ns) != (None, None) and (
                request.expect_size,
                request.expect_mtime_ns,
            ) != (st.st_size, st.st_mtime_ns):
                raise _Problem("changed", f"{path!r} changed during the download")
            digest = None
            if request.offset == 0:
                digest = _hash_files(root, [path]).get(path, ("",))[0] or None
            file.seek(request.offset)
            chunk = file.read(min(request.length, MAX_READ_BYTES))
    entry = WorkspaceFile(
        path=path, kind="file", size=st.st_size, sha256=digest, mtime_ns=st.st_mtime_ns
    )
    return entry, chunk


def _gather(root: Path, path: str, limit: int) -> list[tuple[str, bytes]]:
    """The file ``path``, or every regular file below the directory ``path``, with
    its bytes; symlinks and special files are left out. ``full`` past ``limit``
    bytes in all."""
    try:
        with _opened(root) as dirs:
            if dirs is None:
                raise _Problem("not_found", f"{path!r} is not in the workspace")
            os.close(_open_regular(dirs, path))
        names = [path]
    except _Problem as exc:
        if exc.problem != "not_a_file":
            raise
        tree = _stat_tree(root, path, True)
        names = sorted(rel for rel, st in tree.items() if stat.S_ISREG(st.st_mode))
    files: list[tuple[str, bytes]] = []
    total = 0
    with _opened(root) as dirs:
        if dirs is None:
            raise _Problem("not_found", f"{path!r} is not in the workspace")
        for rel in names:
            try:
                fd = _open_regular(dirs, rel)
            except _Problem:
                continue  # gone or replaced since it was listed
            with os.fdopen(fd, "rb") as file:
                data = file.read(limit - total + 1)
            total += len(data)
            if total > limit:
                raise _Problem("full", f"{path!r} holds more than a workspace can")
            files.append((rel, data))
    return files


def _write(root: Path, path: str, data: bytes) -> WorkspaceFile:
    """Write ``path`` whole, making its directories; never through a symlink."""
    with _opened(root) as dirs:
        if dirs is None:
            raise _Problem("not_found", "the workspace is gone")
        parts = path.split("/")
        made = ""
        for part in parts[:-1]:
            at = dirs.fd(made)
            made = f"{made}/{part}" if made else part
            try:
                os.mkdir(part, 0o755, dir_fd=at)
            except FileExistsError:
                pass
            except OSError as exc:
                raise _missing(path, exc) from None
            try:
                dirs.fd(made)
            except OSError as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise _Problem("not_a_directory", f"{made!r} is not a directory") from None
                raise
        at, name = _parent(dirs, path)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.stat(name, dir_fd=at, follow_symlinks=False).st_mode):
                raise _Problem("not_a_file", f"{path!r} is a directory")
        temporary = f".{name[:200]}.upload-{secrets.token_hex(6)}"
        try:
            fd = os.open(temporary, _WRITE, 0o644, dir_fd=at)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                # Over whatever is there, a symlink included: the link is replaced, not followed.
                os.rename(temporary, name, src_dir_fd=at, dst_dir_fd=at)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary, dir_fd=at)
                raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _Problem("full", "the workspace is full") from None
            if exc.errno == errno.ENAMETOOLONG:
                raise _Problem("invalid_path", f"{path!r} has a name too long") from None
            raise
        st = os.stat(name, dir_fd=at, follow_symlinks=False)
    return WorkspaceFile(
        path=path,
        kind="file",
        size=st.st_size,
        sha256=hashlib.sha256(data).hexdigest(),
        mtime_ns=st.st_mtime_ns,
    )


def _delete(root: Path, path: str) -> None:
    """Remove ``path`` (a directory with all it holds; a symlink itself)."""
    with _opened(root) as dirs:
        if dirs is None:
            raise _Problem("not_found", f"{path!r} is not in the workspace")
        at, name = _parent(dirs, path)
        try:
            st = os.stat(name, dir_fd=at, follow_symlinks=False)
        except OSError as exc:
            raise _missing(path, exc) from None
        _remove_at(at, name, st)
