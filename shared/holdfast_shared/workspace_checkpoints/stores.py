"""Where workspace archives live: PostgreSQL, or a directory every tool-runner reaches.

Both hold the same three things, per tenant: blobs (a file's content, zstd-
compressed, keyed by the SHA-256 of the uncompressed bytes, stored once),
archives (a task's manifest under an id, immutable) and each task's head (the
archive its workspace currently is). ``HOLDFAST_WORKSPACE_STORE`` chooses:
``postgres`` (the default: nothing more to run) or ``file:///path`` (a shared
volume, an NFS mount; blobs are plain files, so a bucket sync can back it up).

Blobs are written before the manifest that names them, and the head last, so a
crash in between leaves unreferenced blobs, never a manifest naming a missing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

from sqlalchemy import Text, delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.sql import Executable

from holdfast_shared.db.models import WorkspaceArchive, WorkspaceBlob, WorkspaceHead
from holdfast_shared.ids import is_valid_id
from holdfast_shared.workspace_checkpoints.manifest import Manifest, ManifestError


class ArchiveStore(Protocol):
    """Blobs, manifests and heads of a tenant's task workspaces."""

    async def missing(self, tenant_id: str, hashes: Collection[str]) -> set[str]:
        """Those of ``hashes`` that have no blob yet."""
        ...

    async def put_blobs(self, tenant_id: str, blobs: Mapping[str, tuple[int, bytes]]) -> None:
        """Store blobs: hash → (uncompressed size, compressed bytes). Idempotent."""
        ...

    async def get_blobs(self, tenant_id: str, hashes: Collection[str]) -> dict[str, bytes]:
        """Compressed bytes by hash; a hash with no blob is absent from the result."""
        ...

    async def put_archive(
        self, tenant_id: str, task_id: str, archive_id: str, manifest: Manifest, reason: str
    ) -> None:
        """Store the archive and make it the task's head."""
        ...

    async def manifest(self, tenant_id: str, task_id: str, archive_id: str) -> Manifest | None:
        """The task's archive (checked: ManifestError if hostile); None if not the task's."""
        ...

    async def head(self, tenant_id: str, task_id: str) -> str | None:
        """The archive the task's workspace currently is, if it was ever archived."""
        ...

    async def set_head(self, tenant_id: str, task_id: str, archive_id: str) -> None: ...

    async def forget_task(self, tenant_id: str, task_id: str) -> None:
        """Drop a deleted task's archives and head (blobs stay: other archives share them)."""
        ...

    async def blob_count(self, tenant_id: str) -> int: ...

    async def stored_bytes(self, tenant_id: str) -> int:
        """Bytes the tenant's blobs and archives take here (what a storage quota counts)."""
        ...


def store_from_settings(setting: str, sessions: async_sessionmaker[AsyncSession]) -> ArchiveStore:
    """The store ``HOLDFAST_WORKSPACE_STORE`` names; ValueError for one that is not."""
    if setting == "postgres":
        return PostgresStore(sessions)
    url = urlparse(setting)
    if url.scheme == "file" and url.netloc in ("", "localhost") and url.path.startswith("/"):
        return DirectoryStore(Path(unquote(url.path)))
    raise ValueError(f"HOLDFAST_WORKSPACE_STORE {setting!r}: expected postgres or file:///path")


class PostgresStore:
    """Blobs as ``bytea`` rows (``workspace_blobs``), manifests as JSONB."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def missing(self, tenant_id: str, hashes: Collection[str]) -> set[str]:
        wanted = set(hashes)
        if not wanted:
            return set()
        async with self.sessions() as session:
            found = await session.scalars(
                select(WorkspaceBlob.sha256).where(
                    WorkspaceBlob.tenant_id == tenant_id, WorkspaceBlob.sha256.in_(wanted)
                )
            )
            return wanted - set(found)

    async def put_blobs(self, tenant_id: str, blobs: Mapping[str, tuple[int, bytes]]) -> None:
        if not blobs:
            return
        rows = [
            {"tenant_id": tenant_id, "sha256": digest, "size": size, "data": data}
            for digest, (size, data) in blobs.items()
        ]
        async with self.sessions.begin() as session:
            await session.execute(insert(WorkspaceBlob).values(rows).on_conflict_do_nothing())

    async def get_blobs(self, tenant_id: str, hashes: Collection[str]) -> dict[str, bytes]:
        wanted = list(set(hashes))
        out: dict[str, bytes] = {}
        if not wanted:
            return out
        async with self.sessions() as session:
            result = await session.execute(
                select(WorkspaceBlob.sha256, WorkspaceBlob.data).where(
                    WorkspaceBlob.tenant_id == tenant_id, WorkspaceBlob.sha256.in_(wanted)
                )
            )
            for digest, data in result:
                out[digest] = bytes(data)
        return out

    async def put_archive(
        self, tenant_id: str, task_id: str, archive_id: str, manifest: Manifest, reason: str
    ) -> None:
        async with self.sessions.begin() as session:
            session.add(
                WorkspaceArchive(
                    id=archive_id,
                    tenant_id=tenant_id,
                    task_id=task_id,
                    manifest=manifest.to_json(),
                    files=manifest.files,
                    total_bytes=manifest.total_bytes,
                    reason=reason,
                )
            )
            await session.flush()
            await session.execute(_upsert_head(tenant_id, task_id, archive_id))

    async def manifest(self, tenant_id: str, task_id: str, archive_id: str) -> Manifest | None:
        async with self.sessions() as session:
            raw = await session.scalar(
                select(WorkspaceArchive.manifest).where(
                    WorkspaceArchive.id == archive_id,
                    WorkspaceArchive.tenant_id == tenant_id,
                    WorkspaceArchive.task_id == task_id,
                )
            )
        return None if raw is None else Manifest.load(raw)

    async def head(self, tenant_id: str, task_id: str) -> str | None:
        async with self.sessions() as session:
            return await session.scalar(
                select(WorkspaceHead.archive_id).where(
                    WorkspaceHead.task_id == task_id, WorkspaceHead.tenant_id == tenant_id
                )
            )

    async def set_head(self, tenant_id: str, task_id: str, archive_id: str) -> None:
        async with self.sessions.begin() as session:
            await session.execute(_upsert_head(tenant_id, task_id, archive_id))

    async def forget_task(self, tenant_id: str, task_id: str) -> None:
        async with self.sessions.begin() as session:
            await session.execute(
                delete(WorkspaceHead).where(
                    WorkspaceHead.task_id == task_id, WorkspaceHead.tenant_id == tenant_id
                )
            )
            await session.execute(
                delete(WorkspaceArchive).where(
                    WorkspaceArchive.task_id == task_id, WorkspaceArchive.tenant_id == tenant_id
                )
            )

    async def blob_count(self, tenant_id: str) -> int:
        async with self.sessions() as session:
            count = await session.scalar(
                select(func.count()).where(WorkspaceBlob.tenant_id == tenant_id)
            )
        return int(count or 0)

    async def stored_bytes(self, tenant_id: str) -> int:
        blobs = select(func.coalesce(func.sum(func.octet_length(WorkspaceBlob.data)), 0)).where(
            WorkspaceBlob.tenant_id == tenant_id
        )
        archives = select(
            func.coalesce(func.sum(func.octet_length(WorkspaceArchive.manifest.cast(Text))), 0)
        ).where(WorkspaceArchive.tenant_id == tenant_id)
        async with self.sessions() as session:
            return int(await session.scalar(blobs) or 0) + int(await session.scalar(archives) or 0)


def _upsert_head(tenant_id: str, task_id: str, archive_id: str) -> Executable:
    statement = insert(WorkspaceHead).values(
        task_id=task_id, tenant_id=tenant_id, archive_id=archive_id
    )
    return statement.on_conflict_do_update(
        index_elements=[WorkspaceHead.task_id],
        set_={"archive_id": archive_id, "tenant_id": tenant_id, "updated_at": func.now()},
    )


class DirectoryStore:
    """Files under ``root``::

        blobs/<tenant>/<hash[:2]>/<hash>          compressed content
        archives/<tenant>/<task>/<archive>.json   {"reason", "manifest"}
        heads/<tenant>/<task>                     the head's archive id

    Every file is written to a temporary name, fsynced and renamed, so a reader
    never sees half of one.
    """

    def __init__(self, root: Path) -> None:
        self.root = root

    def _blob(self, tenant_id: str, digest: str) -> Path:
        return self.root / "blobs" / _id(tenant_id) / digest[:2] / digest

    def _archive(self, tenant_id: str, task_id: str, archive_id: str) -> Path:
        return self.root / "archives" / _id(tenant_id) / _id(task_id) / f"{_id(archive_id)}.json"

    def _head(self, tenant_id: str, task_id: str) -> Path:
        return self.root / "heads" / _id(tenant_id) / _id(task_id)

    async def missing(self, tenant_id: str, hashes: Collection[str]) -> set[str]:
        wanted = set(hashes)
        return await asyncio.to_thread(
            lambda: {h for h in wanted if not self._blob(tenant_id, h).exists()}
        )

    async def put_blobs(self, tenant_id: str, blobs: Mapping[str, tuple[int, bytes]]) -> None:
        def write() -> None:
            written: list[tuple[Path, Path]] = []
            for digest, (_size, data) in blobs.items():
                path = self._blob(tenant_id, digest)
                if path.exists():
                    continue
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                temporary = path.with_name(f".{digest}.{os.getpid()}.tmp")
                temporary.write_bytes(data)
                written.append((temporary, path))
            if not written:
                return
            # One flush of the filesystem per batch instead of an fsync per blob
            # (a thousand small files: seconds): contents durable before their
            # names appear, names durable before a manifest can name them.
            _flush(self.root, [temporary for temporary, _ in written])
            for temporary, path in written:
                os.replace(temporary, path)
            _flush(self.root, sorted({path.parent for _, path in written}))

        await asyncio.to_thread(write)

    async def get_blobs(self, tenant_id: str, hashes: Collection[str]) -> dict[str, bytes]:
        def read() -> dict[str, bytes]:
            out: dict[str, bytes] = {}
            for digest in set(hashes):
                with contextlib.suppress(FileNotFoundError):
                    out[digest] = self._blob(tenant_id, digest).read_bytes()
            return out

        return await asyncio.to_thread(read)

    async def put_archive(
        self, tenant_id: str, task_id: str, archive_id: str, manifest: Manifest, reason: str
    ) -> None:
        body = json.dumps({"reason": reason, "manifest": manifest.to_json()}).encode()
        path = self._archive(tenant_id, task_id, archive_id)
        await asyncio.to_thread(_write_atomic, path, body)
        await self.set_head(tenant_id, task_id, archive_id)

    async def manifest(self, tenant_id: str, task_id: str, archive_id: str) -> Manifest | None:
        if not is_valid_id(archive_id):
            return None
        path = self._archive(tenant_id, task_id, archive_id)
        try:
            raw = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            return None
        try:
            stored = json.loads(raw)
        except ValueError as exc:
            raise ManifestError(f"archive {archive_id} is not JSON") from exc
        return Manifest.load(stored.get("manifest") if isinstance(stored, dict) else None)

    async def head(self, tenant_id: str, task_id: str) -> str | None:
        try:
            text = await asyncio.to_thread(self._head(tenant_id, task_id).read_text)
        except FileNotFoundError:
            return None
        return text.strip() or None

    async def set_head(self, tenant_id: str, task_id: str, archive_id: str) -> None:
        path = self._head(tenant_id, task_id)
        await asyncio.to_thread(_write_atomic, path, _id(archive_id).encode())

    async def forget_task(self, tenant_id: str, task_id: str) -> None:
        def forget() -> None:
            with contextlib.suppress(FileNotFoundError):
                self._head(tenant_id, task_id).unlink()
            shutil.rmtree(self.root / "archives" / _id(tenant_id) / _id(task_id), True)

        await asyncio.to_thread(forget)

    async def blob_count(self, tenant_id: str) -> int:
        def count() -> int:
            base = self.root / "blobs" / _id(tenant_id)
            return sum(len(files) for _dir, _subdirs, files in os.walk(base))

        return await asyncio.to_thread(count)

    async def stored_bytes(self, tenant_id: str) -> int:
        def measure() -> int:
            total = 0
            for part in ("blobs", "archives", "heads"):
                for directory, _subdirs, files in os.walk(self.root / part / _id(tenant_id)):
                    for name in files:
                        with contextlib.suppress(FileNotFoundError):
                            total += os.lstat(os.path.join(directory, name)).st_size
            return total

        return await asyncio.to_thread(measure)


def _id(value: str) -> str:
    # Ids become path components here.
    if not is_valid_id(value) or value in (".", ".."):
        raise ValueError(f"invalid id {value!r}")
    return value


def _syncfs() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    found: Callable[[int], int] | None = getattr(libc, "syncfs", None)
    return found


_SYNCFS = _syncfs()


def _flush(root: Path, paths: list[Path]) -> None:
    """Make ``paths`` (files or directories on ``root``'s filesystem) durable."""
    if _SYNCFS is not None:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if _SYNCFS(fd) == 0:
                return
        finally:
            os.close(fd)
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{id(data):x}.tmp")
    with open(temporary, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
