"""Size-capped filesystems, mounted ``nosuid,nodev``, one per workspace: the disk limit.

A workspace is the one host directory a sandbox may write, so its filesystem is what
bounds the disk a task can fill, and its mount options decide what a file the sandbox
made means on the host (inside, bwrap's own bind is nosuid too). Mechanisms, best
first; ``detect`` picks the first that works here by trying it once for real:

* ``"loop-ext4"``: a sparse image file per workspace, formatted ext4 and loop-mounted
  at the workspace with ``nosuid,nodev,noatime``. Writing past its size fails with
  ENOSPC. The image stays on disk, so the workspace survives a runner restart or a
  reboot (``ensure`` mounts it again). Needs CAP_SYS_ADMIN (root), loop devices
  (``/dev/loop-control``), ``mount`` (util-linux) and ``mkfs.ext4`` (e2fsprogs).
  Each mounted workspace holds a loop device and, for its journal, a kernel thread;
  metadata (journal, inode tables: an inode per 8 KiB) takes a few percent of the
  size. The image is never visible inside a sandbox, so the kernel only ever mounts
  filesystems we formatted, not one a tool crafted.
* ``"tmpfs"``: a tmpfs with ``size=``, ``nosuid,nodev``. Same cap, but the files live
  in memory (or swap) and are gone once it is unmounted: a reboot, or a runner that
  restarts in a new mount namespace (a container), loses the workspace. Needs
  CAP_SYS_ADMIN.
* ``"none"``: a plain directory on the host's filesystem. No size cap beyond
  RLIMIT_FSIZE per file, and the host's mount options; seccomp still refuses setting
  setuid/setgid bits (seccomp.py).

Blocking throughout (mkfs, mount, umount): callers run it in a thread.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Literal

DiskMechanism = Literal["loop-ext4", "tmpfs", "none"]
DISK_MECHANISMS: tuple[DiskMechanism, ...] = ("loop-ext4", "tmpfs", "none")
MOUNT_OPTIONS = "nosuid,nodev,noatime"
# Smallest image mkfs.ext4 formats comfortably (and the trial mount's size).
MIN_BYTES = 4 * 1024 * 1024

_TOOL_PATH = "/usr/sbin:/sbin:/usr/bin:/bin"
_CAP_SYS_ADMIN = 21
_COMMAND_TIMEOUT = 60.0


class DiskError(OSError):
    """A workspace filesystem could not be created, mounted or unmounted; says why."""


def _tool(name: str) -> str | None:
    return shutil.which(name, path=_TOOL_PATH)


def _run(argv: list[str]) -> None:
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=_COMMAND_TIMEOUT,
            env={"PATH": _TOOL_PATH, "LC_ALL": "C"},
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DiskError(f"{argv[0]}: {exc}") from exc
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).decode(errors="replace").strip()
        raise DiskError(f"{' '.join(argv[:3])}...: exit {done.returncode}: {detail}")


def _may_mount() -> bool:
    if os.geteuid() == 0:
        return True
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    return False


def is_mounted(path: Path) -> bool:
    """Whether something is mounted at ``path`` (false if it does not exist)."""
    try:
        return os.path.ismount(path)
    except OSError:
        return False


def mount_options(path: Path) -> set[str]:
    """The per-mount options (``nosuid``, ``nodev``...) of the mount at ``path``."""
    target = str(path)
    found: set[str] = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")[0].split()
        if len(fields) >= 6 and _unescape(fields[4]) == target:
            found = set(fields[5].split(","))  # the last one listed is on top
    return found


def _unescape(point: str) -> str:
    # mountinfo writes space, tab, newline and backslash in octal (\040...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)


def create_image(image: Path, size: int) -> None:
    """A sparse ext4 image of ``size`` bytes at ``image``, made atomically (a temporary
    name, then renamed): a concurrent reader sees no image or a whole one."""
    mkfs = _tool("mkfs.ext4")
    if mkfs is None:
        raise DiskError("mkfs.ext4 is not installed (Debian: apt-get install e2fsprogs)")
    tmp = image.with_name(f"{image.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.truncate(max(size, MIN_BYTES))
        # No reserved blocks; lazy init keeps the image sparse (a fresh file reads as
        # zeros, so nothing stale can be replayed); the root directory owned by us.
        _run(
            [
                mkfs,
                "-q",
                "-F",
                "-m",
                "0",
                "-i",
                # Source trees are many small files: an inode per 8 KiB (twice the
                # default), per 4 KiB on small images (their default).
                "4096" if size < 512 * 1024 * 1024 else "8192",
                "-L",
                "holdfast-ws",
                "-E",
                "nodiscard,lazy_itable_init=1,lazy_journal_init=1,"
                f"root_owner={os.geteuid()}:{os.getegid()}",
                str(tmp),
            ]
        )
        os.replace(tmp, image)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def mount(mechanism: DiskMechanism, target: Path, *, image: Path | None, size: int) -> None:
    """Mount a ``mechanism`` filesystem (``nosuid,nodev``) at ``target`` (an existing,
    empty directory), then make its root ``0700`` and empty."""
    mounter = _tool("mount")
    if mounter is None:
        raise DiskError("mount is not installed (Debian: util-linux / mount)")
    if mechanism == "loop-ext4":
        assert image is not None
        argv = [mounter, "-t", "ext4", "-o", f"loop,{MOUNT_OPTIONS}", str(image), str(target)]
    elif mechanism == "tmpfs":
        size_opt = f"size={max(size, MIN_BYTES)},mode=0700"
        argv = [mounter, "-t", "tmpfs", "-o", f"{size_opt},{MOUNT_OPTIONS}", "holdfast-ws"]
        argv.append(str(target))
    else:
        raise ValueError(f"nothing to mount for {mechanism!r}")
    _run(argv)
    try:
        if not is_mounted(target):
            raise DiskError(f"mount reported success but nothing is mounted at {target}")
        missing = {"nosuid", "nodev"} - mount_options(target)
        if missing:
            raise DiskError(f"{target} mounted without {','.join(sorted(missing))}")
        os.chmod(target, 0o700)
        with contextlib.suppress(FileNotFoundError, OSError):
            (target / "lost+found").rmdir()  # mkfs's; e2fsck makes it again if it needs it
    except BaseException:
        with contextlib.suppress(DiskError):
            unmount(target)
        raise


def unmount(target: Path, *, grace: float = 5.0) -> None:
    """Unmount ``target``, retrying while it is busy; past ``grace`` detach it lazily
    (the filesystem then lives until its last open file closes, nothing reaches it by
    path). Raises DiskError if it is still mounted after that."""
    umount = _tool("umount")
    if umount is None:
        raise DiskError("umount is not installed (Debian: util-linux / mount)")
    deadline = time.monotonic() + grace
    error: DiskError | None = None
    while is_mounted(target):
        lazy = time.monotonic() > deadline
        try:
            _run([umount, *(["-l"] if lazy else []), str(target)])
        except DiskError as exc:
            error = exc
            if lazy:
                break
            time.sleep(0.05)
    if is_mounted(target):
        raise DiskError(f"cannot unmount {target}: {error}")


def detect(scratch: Path, requested: str = "auto") -> tuple[DiskMechanism, str | None]:
    """The mechanism to use for workspaces under ``scratch`` (an existing directory):
    ``requested`` if it is one of DISK_MECHANISMS (DiskError if it does not work here),
    else the best that a trial mount proves. Also returns why better ones were not
    used (None when the best is in force)."""
    if requested not in ("auto", *DISK_MECHANISMS):
        raise ValueError(f"unknown workspace filesystem {requested!r}")
    wanted: tuple[DiskMechanism, ...]
    if requested == "auto":
        wanted = DISK_MECHANISMS
    else:
        wanted = (requested,)  # type: ignore[assignment]
    problems: list[str] = []
    for mechanism in wanted:
        if mechanism == "none":
            break
        try:
            _trial(scratch, mechanism)
        except DiskError as exc:
            problems.append(f"{mechanism}: {exc}")
            continue
        return mechanism, "; ".join(problems) or None
    if requested != "auto" and requested != "none":
        raise DiskError("; ".join(problems))
    return "none", "; ".join(problems) or None


def _clear_stale_trials(scratch: Path) -> None:
    """Remove what a trial of a runner that died mid-way left (``.probe-<pid>-...``)."""
    with contextlib.suppress(OSError):
        for entry in scratch.iterdir():
            owner = entry.name.removeprefix(".probe-").partition("-")[0]
            if not entry.name.startswith(".probe-") or not owner.isdigit():
                continue
            if Path(f"/proc/{owner}").exists():
                continue  # a live runner's trial, or a new process with its pid: leave it
            with contextlib.suppress(DiskError, OSError):
                if is_mounted(entry):
                    unmount(entry, grace=0)
                if entry.is_dir():
                    entry.rmdir()
                else:
                    entry.unlink()


def _trial(scratch: Path, mechanism: DiskMechanism) -> None:
    _clear_stale_trials(scratch)
    if not _may_mount():
        raise DiskError("mounting needs root or CAP_SYS_ADMIN")
    if mechanism == "loop-ext4" and not Path("/dev/loop-control").exists():
        raise DiskError("no loop devices (/dev/loop-control is missing)")
    name = f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    target, image = scratch / name, scratch / f"{name}.img"
    target.mkdir(mode=0o700)
    try:
        if mechanism == "loop-ext4":
            create_image(image, MIN_BYTES)
        mount(mechanism, target, image=image, size=MIN_BYTES)
        unmount(target)
    finally:
        with contextlib.suppress(OSError):
            target.rmdir()
        with contextlib.suppress(FileNotFoundError):
            image.unlink()
