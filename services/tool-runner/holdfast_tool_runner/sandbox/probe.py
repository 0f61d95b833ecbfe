"""What the sandbox can use on this host, for /health and for start-up logs.

``limits`` names the mechanism in force for each limit of a call (limits.py, disk.py):
``pids``: cgroup2 | cgroup1 | rlimit; ``memory``: cgroup2 | cgroup1 | rss-budget;
``cpu``: cgroup2 | cgroup1 | time-budget; ``file_size``: rlimit; ``kill``: cgroup2 |
cgroup1 | session; ``disk``: loop-ext4 | tmpfs | none (as the runner's workspaces
report it, ``unknown`` if it did not pass them).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from . import landlock, network, seccomp
from .limits import hierarchies
from .policy import SandboxPolicy, SandboxUnavailable
from .runner import run_sandboxed


@dataclass(frozen=True)
class SandboxProbe:
    """Each layer's state; ``available`` means a real sandboxed ``true`` just ran."""

    available: bool
    problem: str | None
    bwrap_version: str | None
    user_namespaces: bool
    seccomp: bool
    landlock_abi: int
    cgroup2: bool
    cgroup2_controllers: tuple[str, ...]
    limits: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # Where a sandbox with network goes: "slirp4netns" (its own namespace, the host's
    # loopback refused) or "host" (slirp4netns not installed: the host's namespace).
    network: str = "host"
    # The workspaces' filesystem: {"disk", "max_bytes", "problem"} (Workspaces.describe).
    workspaces: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def as_dict(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "problem": self.problem,
            "bwrap_version": self.bwrap_version,
            "user_namespaces": self.user_namespaces,
            "seccomp": self.seccomp,
            "landlock_abi": self.landlock_abi,
            "cgroup2": self.cgroup2,
            "cgroup2_controllers": list(self.cgroup2_controllers),
            "limits": dict(self.limits),
            "network": self.network,
            "workspaces": dict(self.workspaces),
        }


async def _bwrap_version() -> str | None:
    path = shutil.which("bwrap")
    if path is None:
        return None
    proc = await asyncio.create_subprocess_exec(
        path, "--version", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
    )
    out, _ = await proc.communicate()
    return out.decode().strip().removeprefix("bubblewrap ") or None


def _user_namespaces() -> bool:
    try:
        return int(Path("/proc/sys/user/max_user_namespaces").read_text()) > 0
    except (OSError, ValueError):
        return False


async def probe(*, workspaces: Mapping[str, Any] | None = None) -> SandboxProbe:
    """Check every layer, then run ``true`` in a real sandbox to prove they combine.

    ``workspaces``: the runner's ``Workspaces.describe()``, reported with the limits.
    """
    problems: list[str] = []
    version = await _bwrap_version()
    try:
        seccomp.filter_program(network=False)
        seccomp_ok = True
    except SandboxUnavailable as exc:
        seccomp_ok = False
        problems.append(str(exc))
    try:
        abi = landlock.kernel_abi()
    except OSError as exc:
        abi = 0
        problems.append(f"landlock: {exc}")
    cgroups = hierarchies()
    try:
        limits = cgroups.mechanisms().as_dict()
    except SandboxUnavailable as exc:
        limits = {}
        problems.append(str(exc))
    limits["disk"] = str((workspaces or {}).get("disk", "unknown"))

    slirp = network.slirp4netns()
    # A workspace whose parent is closed to other users, as run_sandboxed requires.
    parent = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="holdfast-probe-"))
    try:
        workspace = parent / "workspace"
        workspace.mkdir()
        policy = SandboxPolicy(workspace=workspace, timeout_seconds=10)
        result = await run_sandboxed(["true"], policy)
        if result.exit_code != 0:
            problems.append(f"sandboxed `true` failed: {result.stderr.strip()}")
        if slirp is not None:
            online = await run_sandboxed(["true"], dataclasses.replace(policy, network=True))
            if online.exit_code != 0:
                problems.append(f"sandboxed `true` with network failed: {online.stderr.strip()}")
    except SandboxUnavailable as exc:
        problems.append(str(exc))
    finally:
        await asyncio.to_thread(shutil.rmtree, parent, True)

    return SandboxProbe(
        available=not problems,
        problem="; ".join(dict.fromkeys(problems)) or None,
        bwrap_version=version,
        user_namespaces=_user_namespaces(),
        seccomp=seccomp_ok,
        landlock_abi=abi,
        cgroup2=cgroups.v2 is not None,
        cgroup2_controllers=tuple(sorted(cgroups.v2_controllers)),
        limits=MappingProxyType(limits),
        network="slirp4netns" if slirp else "host",
        workspaces=MappingProxyType(dict(workspaces or {})),
    )
