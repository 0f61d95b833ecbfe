"""Resource limits and the kill switch of one sandboxed call.

Each call gets its own cgroups, joined by its launcher before it executes bwrap
(launchers.py), so everything the command starts is inside them:

* cgroup v2, under ``<our cgroup>/holdfast-sandbox/<runner pid>-<random>``. If the
  pids, memory and cpu controllers can be enabled for that subtree, they carry
  ``pids.max``, ``memory.max`` (swap 0, OOM kills the whole group) and ``cpu.max``.
  With or without controllers, ``cgroup.kill`` ends every process of the call at once.
  Enabling controllers needs a delegated subtree: a (non-root) cgroup that holds
  processes itself cannot hand controllers to children (EBUSY). Under systemd that
  means ``Delegate=yes`` and the runner started in a sub-cgroup of its unit; in a
  container, a writable cgroupfs and an entrypoint that moved itself into a leaf.
  We never move the runner ourselves; without controllers the fallbacks below apply.
* cgroup v1 ``pids`` when v2 cannot bound processes (hybrid hosts mount v2 without
  controllers and the v1 controllers beside it).
* rlimits, set on the launcher (prlimit) before it executes bwrap, for the rest:
  RLIMIT_AS for memory, RLIMIT_CPU (total CPU seconds, a backstop rather than a
  rate) for cpu, RLIMIT_NPROC for processes.
  RLIMIT_NPROC counts every process of the real uid host-wide and is never enforced
  for uid 0, so as root without a pids cgroup there is no way to stop a fork bomb:
  that fails closed. RLIMIT_FSIZE (the disk-fill guard) and RLIMIT_CORE=0 always.

The wall-clock timeout lives in the runner; this module kills. Which mechanism
enforced each limit is reported in ``Mechanisms`` and in every result.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import resource
import secrets
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .policy import SandboxPolicy, SandboxUnavailable

SUBTREE = "holdfast-sandbox"
_CONTROLLERS = ("pids", "memory", "cpu")
_CPU_PERIOD_US = 100_000


def _read(path: Path) -> str:
    return path.read_text().strip()


def _write(path: Path, value: str) -> None:
    # cgroupfs writes are in-kernel and immediate: no need to leave the event loop.
    with open(path, "w") as f:
        f.write(value)


class Cgroup:
    """One cgroup directory, v1 or v2."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def procs(self) -> list[int]:
        try:
            return [int(p) for p in _read(self.path / "cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def counter(self, file: str, key: str) -> int:
        """A ``key value`` line of a flat-keyed file such as memory.events; 0 if absent."""
        try:
            for line in _read(self.path / file).splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        except (FileNotFoundError, ValueError):
            pass
        return 0

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (``cgroup.kill`` where the kernel has it)."""
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():
            with contextlib.suppress(FileNotFoundError):
                _write(kill_file, "1")
            return
        # v1: kill what is listed until nothing is; the pids limit keeps the list finite.
        for _ in range(100):
            pids = self.procs()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    async def remove(self, grace: float = 2.0) -> bool:
        """Kill, wait until empty, rmdir. False if it would not empty in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while True:
            self.kill()
            try:
                self.path.rmdir()
                return True
            except FileNotFoundError:
                return True
            except OSError:  # EBUSY: dying processes not yet gone
                if loop.time() > deadline:
                    return False
                await asyncio.sleep(0.005)


@dataclass(frozen=True)
class Mechanisms:
    """How each limit is enforced on this host."""

    pids: str
    memory: str
    cpu: str
    kill: str
    file_size: str = "rlimit"

    def as_dict(self) -> dict[str, str]:
        return {
            "pids": self.pids,
            "memory": self.memory,
            "cpu": self.cpu,
            "file_size": self.file_size,
            "kill": self.kill,
        }


@dataclass(frozen=True)
class Hierarchies:
    """Where per-call cgroups go on this host, found once per process."""

    v2: Path | None  # our v2 subtree, if we could create it
    v2_controllers: frozenset[str]  # controllers its children get
    v1_pids: Path | None  # our v1 pids subtree, if any

    def mechanisms(self) -> Mechanisms:
        """Raises SandboxUnavailable if the number of processes cannot be bounded."""
        if "pids" in self.v2_controllers:
            pids = "cgroup2"
        elif self.v1_pids is not None:
            pids = "cgroup1"
        elif os.geteuid() != 0:
            pids = "rlimit"
        else:
            raise SandboxUnavailable(
                "limits: cannot bound the number of processes: no pids controller is "
                "delegated to our cgroup (v2) or mounted (v1), and RLIMIT_NPROC does not "
                "apply to root"
            )
        return Mechanisms(
            pids=pids,
            memory="cgroup2" if "memory" in self.v2_controllers else "rlimit",
            cpu="cgroup2" if "cpu" in self.v2_controllers else "rlimit",
            kill="cgroup2" if self.v2 else "cgroup1" if self.v1_pids else "session",
        )

    def orphans(self) -> Iterator[Cgroup]:
        """Per-call cgroups whose runner process is gone (it crashed mid-call)."""
        for subtree in (self.v2, self.v1_pids):
            if subtree is None:
                continue
            with contextlib.suppress(FileNotFoundError):
                for child in subtree.iterdir():
                    if child.is_dir() and not _owner_alive(child.name):
                        yield Cgroup(child)


def _owner_alive(name: str) -> bool:
    owner, _, _ = name.partition("-")
    if not owner.isdigit():
        return False  # not one of ours as named now: nobody owns it
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's (a runner of another uid sharing the subtree)
    return True


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of every mount, from mountinfo."""
    mounts = []
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) >= 5 and len(post_fields) >= 3:
            mounts.append((fields[4], post_fields[0], post_fields[2]))
    return mounts


def _own_cgroups() -> dict[str, str]:
    """Our cgroup path per hierarchy: "" for v2, the controller name for v1."""
    own: dict[str, str] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            own[name] = path
    return own


def _setup_v2(base: Path) -> tuple[Path, frozenset[str]] | None:
    subtree = base / SUBTREE
    try:
        subtree.mkdir(exist_ok=True)
    except OSError:
        return None
    try:
        offered = set(_read(base / "cgroup.controllers").split()) & set(_CONTROLLERS)
        enabled = set(_read(base / "cgroup.subtree_control").split())
        for name in sorted(offered - enabled):
            # EBUSY when our own cgroup holds processes (no-internal-process rule).
            with contextlib.suppress(OSError):
                _write(base / "cgroup.subtree_control", f"+{name}")
        for name in sorted(set(_read(subtree / "cgroup.controllers").split()) & offered):
            with contextlib.suppress(OSError):
                _write(subtree / "cgroup.subtree_control", f"+{name}")
        leaf = set(_read(subtree / "cgroup.subtree_control").split()) & set(_CONTROLLERS)
    except OSError:
        leaf = set()
    return subtree, frozenset(leaf)


def _setup_v1_pids(mount: str, own: str) -> Path | None:
    subtree = Path(mount + own.rstrip("/")) / SUBTREE
    try:
        subtree.mkdir(exist_ok=True)
    except OSError:
        return None
    return subtree if (subtree / "pids.max").exists() else None


@functools.cache
def hierarchies() -> Hierarchies:
    """Find (and prepare, once) the cgroup subtrees this process may use."""
    own = _own_cgroups()
    v2: tuple[Path, frozenset[str]] | None = None
    v1_pids: Path | None = None
    for mount, fstype, options in _mounts():
        if fstype == "cgroup2" and v2 is None and "" in own:
            v2 = _setup_v2(Path(mount + own[""].rstrip("/")))
        elif fstype == "cgroup" and "pids" in options.split(",") and "pids" in own:
            v1_pids = _setup_v1_pids(mount, own["pids"])
    controllers = v2[1] if v2 else frozenset()
    if "pids" in controllers:
        v1_pids = None  # v2 bounds processes; one mechanism is enough
    return Hierarchies(v2=v2[0] if v2 else None, v2_controllers=controllers, v1_pids=v1_pids)


class CallLimits:
    """The cgroups of one call, created empty before its process exists.

    Named ``<pid of this runner>-<random>``: the workspace is not known yet when a
    launcher is spawned ahead of its call (and cgroup v2 cannot rename), and the owner's
    pid is what tells a dead runner's leftovers (``Hierarchies.orphans``).
    """

    def __init__(self, found: Hierarchies) -> None:
        self.mechanisms = found.mechanisms()
        self.cgroups: list[Cgroup] = []
        self._controllers: list[frozenset[str]] = []
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        try:
            if found.v2 is not None:
                self._create(Cgroup(found.v2 / name), found.v2_controllers)
            if self.mechanisms.pids == "cgroup1" and found.v1_pids is not None:
                self._create(Cgroup(found.v1_pids / name), frozenset({"pids"}))
        except OSError as exc:
            self.discard()
            raise SandboxUnavailable(f"limits: cannot create the call's cgroup: {exc}") from exc

    def _create(self, cgroup: Cgroup, controllers: frozenset[str]) -> None:
        cgroup.path.mkdir()
        self.cgroups.append(cgroup)
        self._controllers.append(controllers)

    def join(self, pid: int) -> None:
        """Move ``pid`` into the call's cgroups.

        Blocks: the kernel takes the cgroup threadgroup lock for writing, which waits for
        an RCU grace period (10-15 ms unless another move just happened). Run it in a
        thread, ahead of the call.
        """
        for cgroup in self.cgroups:
            _write(cgroup.path / "cgroup.procs", str(pid))

    def apply(self, policy: SandboxPolicy, pid: int) -> None:
        """Set the policy's limits on the cgroups and, as rlimits, on ``pid`` (not yet
        running the command; everything it starts inherits them)."""
        for cgroup, controllers in zip(self.cgroups, self._controllers, strict=True):
            if "pids" in controllers:
                _write(cgroup.path / "pids.max", str(policy.pids_max))
            if "memory" in controllers:
                _write(cgroup.path / "memory.max", str(policy.memory_bytes))
                for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    if (cgroup.path / name).exists():
                        _write(cgroup.path / name, value)
            if "cpu" in controllers:
                quota = max(1000, int(policy.cpu_quota * _CPU_PERIOD_US))
                _write(cgroup.path / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
        for which, limit in self._rlimits(policy):
            resource.prlimit(pid, which, (limit, limit))

    def _rlimits(self, policy: SandboxPolicy) -> list[tuple[int, int]]:
        plan = [
            (resource.RLIMIT_FSIZE, policy.file_size_bytes),
            (resource.RLIMIT_CORE, 0),
        ]
        if self.mechanisms.memory == "rlimit":
            plan.append((resource.RLIMIT_AS, policy.memory_bytes))
        if self.mechanisms.cpu == "rlimit":
            plan.append(
                (resource.RLIMIT_CPU, math.ceil(policy.timeout_seconds * policy.cpu_quota) + 1)
            )
        if self.mechanisms.pids == "rlimit":
            plan.append((resource.RLIMIT_NPROC, policy.pids_max))
        return plan

    def kill(self) -> None:
        for cgroup in self.cgroups:
            cgroup.kill()

    def events(self) -> tuple[str, ...]:
        """The limits the call ran into."""
        hit = []
        if any(c.counter("pids.events", "max") for c in self.cgroups):
            hit.append("pids")
        if any(c.counter("memory.events", "oom_kill") for c in self.cgroups):
            hit.append("memory")
        return tuple(hit)

    async def release(self) -> None:
        """Kill whatever is left and remove the cgroups."""
        for cgroup in self.cgroups:
            await cgroup.remove()

    def discard(self) -> None:
        """Undo a set-up that failed before any process joined."""
        for cgroup in self.cgroups:
            with contextlib.suppress(OSError):
                cgroup.path.rmdir()
