"""The values that cross the sandbox boundary: what a call may do, and what came of it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

# A skill's name (holdfast_shared.skills.format): one path component, never . or ..
_SKILL_NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]*")

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be set up, so the command was not run. The message says why.

    ``transient``: a set-up that may well succeed when tried again (nothing ran).
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


@dataclass(frozen=True)
class SandboxPolicy:
    """What one sandboxed call may use.

    ``workspace`` is the only writable host directory (mounted at ``/workspace``, the
    working directory). Everything else is a limit; the defaults suit a shell tool call.
    ``memory_bytes``, ``pids_max`` and ``cpu_quota`` bound the call as a whole (all its
    processes together: limits.py says how on each host).
    """

    workspace: Path
    network: bool = False
    timeout_seconds: float = 60.0
    memory_bytes: int = 1 * GiB
    pids_max: int = 256
    # CPU time per wall-clock second, in cores (cgroup cpu.max); 1.0 is one full core.
    cpu_quota: float = 1.0
    # Cap on each of stdout and stderr; the rest is read and discarded.
    max_output_bytes: int = 64 * KiB
    # Largest file a process may write (RLIMIT_FSIZE). The workspace's own filesystem
    # caps their total (disk.py, HOLDFAST_WORKSPACE_MAX_BYTES).
    file_size_bytes: int = 256 * MiB
    # Size of each private tmpfs (/tmp and /dev/shm), which live in host memory.
    tmpfs_bytes: int = 64 * MiB
    # Host directories bound read-only at the same path (besides /usr and the
    # rest bwrap.py always binds): where an operator installed an MCP stdio
    # server's code. Absolute, and never a system directory's parent.
    read_only_paths: tuple[Path, ...] = ()
    # Skills' folders, (host directory, skill name): each mounted read-only at
    # /workspace/.skills/<name>, on a read-only /workspace/.skills (bwrap.py).
    skill_mounts: tuple[tuple[Path, str], ...] = ()
    # Set in the call's environment beside the sandbox's own (bwrap.ENV), which
    # they never replace: the call's HOLDFAST_IDEMPOTENCY_KEY.
    env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.workspace.is_absolute():
            raise ValueError(f"workspace must be an absolute path, got {self.workspace}")
        for path in self.read_only_paths:
            if not path.is_absolute() or path == Path("/"):
                raise ValueError(f"a read-only path must be absolute and not /, got {path}")
        for folder, name in self.skill_mounts:
            if not folder.is_absolute() or not _SKILL_NAME.fullmatch(name):
                raise ValueError(f"a skill mount is an absolute folder and a name: {name!r}")
        for key, value in self.env:
            if not _ENV_NAME.fullmatch(key) or "\0" in value:
                raise ValueError(f"not an environment variable: {key!r}")
        for name in (
            "timeout_seconds",
            "memory_bytes",
            "pids_max",
            "cpu_quota",
            "max_output_bytes",
            "file_size_bytes",
            "tmpfs_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed call did.

    ``exit_code`` is None when the sandbox was killed from outside (timeout, reaped,
    or the memory limit killed the whole group). An exit code above 128 is read as
    death by signal 128+N (as shells do, and as bubblewrap reports it), which sets
    ``killed_reason``: ``"timeout"``, ``"reaped"``, ``"memory"``, ``"file_size"``,
    ``"cpu_time"`` or ``"signal:SIGNAME"``. ``limit_events`` names the limits the
    call ran into even if it survived them (``"pids"``, ``"memory"``), and
    ``mechanisms`` says how each limit was enforced on this host.
    """

    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool
    timed_out: bool
    killed_reason: str | None
    duration_ms: float
    limit_events: tuple[str, ...] = ()
    mechanisms: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None
