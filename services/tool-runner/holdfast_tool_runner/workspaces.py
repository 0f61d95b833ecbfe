"""Per-task workspaces: one size-capped directory per (tenant, task), kept across turns.

Layout under the root (mode 0700, so nothing in it is reachable by other host users)::

    <root>/.lock                      flock: creation and removal, across runners
    <root>/<tenant>/<task>/           the workspace (a mount point unless disk is "none")
    <root>/<tenant>/.<task>.img       its ext4 image (disk "loop-ext4")

The task id is minted by the engine and never reused, so a workspace never outlives
into another task. Ids cannot start with ".", so the dot-names never collide with them.
Each workspace is its own filesystem of ``max_bytes``, mounted ``nosuid,nodev`` (see
sandbox/disk.py for the mechanisms and their fallback, ``disk``). A workspace is
created on the task's first tool call (``ensure``) and removed when the task is
deleted (``remove``), or by a sweeper for tasks that no longer exist (``orphans``).

Synchronous: ``ensure`` and ``remove`` run mkfs, mount and rmtree. Async callers use
``asyncio.to_thread``. Safe to call from several threads and several runner
processes sharing the root on one host (in one mount namespace).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from holdfast_shared.ids import is_valid_id
from holdfast_shared.settings import Settings

from holdfast_tool_runner.sandbox import disk
from holdfast_tool_runner.sandbox.disk import DiskError, DiskMechanism

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
_REMOVE_GRACE_SECONDS = 10.0


class WorkspaceError(RuntimeError):
    """A workspace could not be created or completely removed; the message says why."""


class Workspaces:
    """The workspaces under ``root``, each capped at ``max_bytes``.

    ``filesystem``: ``"auto"`` (the best mechanism a trial mount proves here),
    ``"loop-ext4"``, ``"tmpfs"`` or ``"none"``; an explicit one that does not work
    raises WorkspaceError here, so the runner does not start without it. The
    constructor blocks for the trial (tens of milliseconds).
    """

    def __init__(
        self, root: Path, *, max_bytes: int = DEFAULT_MAX_BYTES, filesystem: str = "auto"
    ) -> None:
        if max_bytes < disk.MIN_BYTES:
            raise ValueError(f"workspace max_bytes must be at least {disk.MIN_BYTES}")
        self.root = root
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.disk: DiskMechanism
        self.disk_problem: str | None
        try:
            self.disk, self.disk_problem = disk.detect(self.root, filesystem)
        except DiskError as exc:
            raise WorkspaceError(f"workspace filesystem {filesystem!r}: {exc}") from exc
        if self.disk_problem:
            log.warning("workspaces use disk %r: %s", self.disk, self.disk_problem)

    @classmethod
    def from_settings(cls, settings: Settings) -> Workspaces:
        """From ``HOLDFAST_WORKSPACE_ROOT``, ``..._MAX_BYTES`` and ``..._FS``."""
        return cls(
            settings.workspaces,
            max_bytes=settings.workspace_max_bytes,
            filesystem=settings.workspace_fs,
        )

    def describe(self) -> dict[str, Any]:
        """For /health: the disk mechanism in force, the cap, and why not a better one."""
        return {"disk": self.disk, "max_bytes": self.max_bytes, "problem": self.disk_problem}

    # -- paths -------------------------------------------------------------------

    def path(self, tenant_id: str, task_id: str) -> Path:
        """``<root>/<tenant_id>/<task_id>``; ValueError for an id that is not one."""
        # Ids are validated where they are minted or received; checked again because
        # they become a path on the host.
        for kind, value in (("tenant", tenant_id), ("task", task_id)):
            if not is_valid_id(value) or value in (".", ".."):
                raise ValueError(f"invalid {kind} id {value!r}")
        return self.root / tenant_id / task_id

    def _image(self, path: Path) -> Path:
        return path.with_name(f".{path.name}.img")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- lifecycle ---------------------------------------------------------------

    def ensure(self, tenant_id: str, task_id: str) -> Path:
        """The workspace, created (and its filesystem made and mounted) if needed.

        Idempotent; concurrent calls (threads or runners) create it once. Raises
        WorkspaceError if its filesystem cannot be mounted: never hands out an
        uncapped directory when a cap is in force.
        """
        path = self.path(tenant_id, task_id)
        if self._ready(path):
            return path
        with self._locked():
            if self._ready(path):
                return path
            path.parent.mkdir(mode=0o700, exist_ok=True)
            path.mkdir(mode=0o700, exist_ok=True)
            if self.disk != "none":
                try:
                    self._mount(path)
                except (DiskError, OSError) as exc:
                    raise WorkspaceError(f"workspace {tenant_id}/{task_id}: {exc}") from exc
        return path

    def exists(self, tenant_id: str, task_id: str) -> bool:
        """Whether the task's workspace is here, ready (mounted unless disk is "none")."""
        return self._ready(self.path(tenant_id, task_id))

    def _ready(self, path: Path) -> bool:
        if self.disk == "none":
            return path.is_dir()
        return disk.is_mounted(path)

    def _mount(self, path: Path) -> None:
        image = self._image(path)
        if self.disk != "loop-ext4" and image.exists():
            # Made by a runner that could loop-mount: mounting anything else here would
            # hide its files behind an empty filesystem.
            raise DiskError(f"its files are in {image.name}, which disk {self.disk!r} cannot mount")
        if self.disk == "loop-ext4" and not image.exists():
            disk.create_image(image, self.max_bytes)
        leftovers = os.listdir(path)
        if not leftovers:
            disk.mount(self.disk, path, image=image, size=self.max_bytes)
            return
        # Files in the bare directory (written while the disk mechanism was "none"):
        # move them into the capped filesystem rather than hide them under it.
        staging = path.with_name(f".{path.name}.staging")
        staging.mkdir(mode=0o700, exist_ok=True)
        disk.mount(self.disk, staging, image=image, size=self.max_bytes)
        try:
            for name in leftovers:
                shutil.move(str(path / name), str(staging / name))
        finally:
            disk.unmount(staging)
            staging.rmdir()
        disk.mount(self.disk, path, image=image, size=self.max_bytes)

    def remove(self, tenant_id: str, task_id: str) -> bool:
        """Remove the workspace completely: unmount it, delete its image and every
        file, and the tenant's directory once empty. False if there was nothing.

        Kill the task's calls first (``reap_leftovers``); a process still creating
        files is outrun (rmtree is retried on "Directory not empty"). Raises
        WorkspaceError, naming what is left, if it cannot finish in time.
        """
        path = self.path(tenant_id, task_id)
        image = self._image(path)
        with self._locked():
            if not os.path.lexists(path) and not image.exists():
                return False
            deadline = time.monotonic() + _REMOVE_GRACE_SECONDS
            try:
                if disk.is_mounted(path):
                    disk.unmount(path)
                with contextlib.suppress(FileNotFoundError):
                    image.unlink()
                _rmtree(path, deadline)
            except (DiskError, OSError) as exc:
                raise WorkspaceError(
                    f"workspace {tenant_id}/{task_id} only partly removed: {exc}"
                ) from exc
            with contextlib.suppress(OSError):  # not empty: another task of the tenant
                path.parent.rmdir()
        return True

    def unmount_all(self) -> int:
        """Unmount every workspace under the root; how many were mounted.

        For tear-down: a root about to be deleted (tests, a throwaway data dir) cannot
        be while workspaces are mounted in it, and ``rm -r`` would descend into them.
        A "loop-ext4" workspace keeps its files in its image (the next ``ensure``
        mounts it again); a "tmpfs" one loses them. A runner that merely restarts
        needs none of this: ``ensure`` reuses what is still mounted.
        """
        count = 0
        with self._locked():
            for tenant, task in self.list():
                path = self.path(tenant, task)
                if disk.is_mounted(path):
                    try:
                        disk.unmount(path)
                    except DiskError as exc:
                        raise WorkspaceError(f"workspace {tenant}/{task}: {exc}") from exc
                    count += 1
        return count

    # -- what is on disk -----------------------------------------------------------

    def list(self) -> builtins.list[tuple[str, str]]:
        """Every (tenant, task) with a workspace or an image on disk."""
        found: set[tuple[str, str]] = set()
        with contextlib.suppress(FileNotFoundError):
            for tenant in os.scandir(self.root):
                if not (is_valid_id(tenant.name) and tenant.is_dir(follow_symlinks=False)):
                    continue
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    for entry in os.scandir(tenant.path):
                        name = entry.name
                        if name.startswith(".") and name.endswith(".img"):
                            name = name[1:-4]
                        elif not entry.is_dir(follow_symlinks=False):
                            continue
                        if is_valid_id(name):
                            found.add((tenant.name, name))
        return sorted(found)

    def orphans(self, live: Callable[[str, str], bool]) -> builtins.list[tuple[str, str]]:
        """The (tenant, task) workspaces on disk for which ``live(tenant, task)`` is
        false: the sweeper then ``remove``s them. ``live`` is called from this thread;
        an async caller can instead filter ``list()`` itself."""
        return [(tenant, task) for tenant, task in self.list() if not live(tenant, task)]


def _rmtree(path: Path, deadline: float) -> None:
    """rmtree that outlasts files being created meanwhile, and mode-000 directories."""

    def unlock(func: Callable[..., Any], target: str, exc: BaseException) -> None:
        if isinstance(exc, PermissionError):
            # A directory the sandbox made unwritable (only matters when not root).
            for where in (os.path.dirname(target), target):
                with contextlib.suppress(OSError):
                    mode = os.lstat(where).st_mode
                    if stat.S_ISDIR(mode):
                        os.chmod(where, 0o700)
            func(target)
            return
        raise exc

    while True:
        try:
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=unlock)
            else:
                shutil.rmtree(path, onerror=lambda f, t, info: unlock(f, t, info[1]))
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EBUSY):
                raise
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
