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
* cgroup v1, for each of ``pids``, ``memory`` and ``cpu`` that v2 cannot bound (hybrid
  hosts mount v2 without controllers and the v1 controllers beside it): ``pids.max``;
  ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (memory plus swap,
  where swap accounting is on; otherwise swappiness 0); ``cpu.cfs_quota_us``. A v1
  OOM kills one process, not the group: the runner's watch (``CallLimits.over``)
  sees ``oom_kill`` and kills the whole call, as v2's ``memory.oom.group`` does.
* where no cgroup can bound them, per-call budgets the runner's watch enforces by
  polling the call's processes every ``WATCH_SECONDS`` and killing the whole call:
  ``rss-budget`` for memory (the sum of their proportional anonymous and shared
  memory, from ``smaps_rollup``), ``time-budget`` for CPU (the sum of their CPU
  time, reaped children included, against ``timeout x cpu_quota``: a total, not a
  rate). Polling is soft (a call can overshoot between two looks), so each process
  also keeps an rlimit backstop: RLIMIT_AS, RLIMIT_CPU.
* RLIMIT_NPROC for processes when not root and no pids cgroup. It counts every
  process of the real uid host-wide and is never enforced for uid 0, so as root
  without a pids cgroup there is no way to stop a fork bomb: that fails closed.
  RLIMIT_FSIZE (per file; the workspace's own filesystem caps the total: disk.py)
  and RLIMIT_CORE=0 always.

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
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from .policy import SandboxPolicy, SandboxUnavailable

SUBTREE = "holdfast-sandbox"
_CONTROLLERS = ("pids", "memory", "cpu")
# A v1 hierarchy is ours to use if this file of the controller exists in it.
_V1_PROBE = {"pids": "pids.max", "memory": "memory.limit_in_bytes", "cpu": "cpu.cfs_quota_us"}
_CPU_PERIOD_US = 100_000
# How often the runner's watch looks at a call whose limits no cgroup fully enforces.
WATCH_SECONDS = 0.1
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


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

    def tree_procs(self) -> list[int]:
        """Every process of the cgroup and its descendant cgroups."""
        found = self.procs()
        with contextlib.suppress(FileNotFoundError):
            for child in self.path.iterdir():
                if child.is_dir():
                    found += Cgroup(child).tree_procs()
        return found

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
    # Our v1 subtree per controller, only for controllers v2 does not give us. Two
    # controllers mounted together (cpu,cpuacct with pids) share one subtree.
    v1: Mapping[str, Path] = field(default_factory=lambda: MappingProxyType({}), hash=False)

    @property
    def v1_pids(self) -> Path | None:
        return self.v1.get("pids")

    def subtrees(self) -> list[Path]:
        """Every subtree holding per-call cgroups, v2 first, each once."""
        found = [self.v2] if self.v2 is not None else []
        return list(dict.fromkeys([*found, *self.v1.values()]))

    def _mechanism(self, controller: str, fallback: str) -> str:
        if controller in self.v2_controllers:
            return "cgroup2"
        return "cgroup1" if controller in self.v1 else fallback

    def mechanisms(self) -> Mechanisms:
        """Raises SandboxUnavailable if the number of processes cannot be bounded."""
        pids = self._mechanism("pids", "rlimit")
        if pids == "rlimit" and os.geteuid() == 0:
            raise SandboxUnavailable(
                "limits: cannot bound the number of processes: no pids controller is "
                "delegated to our cgroup (v2) or mounted (v1), and RLIMIT_NPROC does not "
                "apply to root"
            )
        return Mechanisms(
            pids=pids,
            memory=self._mechanism("memory", "rss-budget"),
            cpu=self._mechanism("cpu", "time-budget"),
            kill="cgroup2" if self.v2 else "cgroup1" if self.v1 else "session",
        )

    def orphans(self) -> Iterator[Cgroup]:
        """Per-call cgroups whose runner process is gone (it crashed mid-call)."""
        for subtree in self.subtrees():
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


def _setup_v1(mount: str, own: str, controller: str) -> Path | None:
    subtree = Path(mount + own.rstrip("/")) / SUBTREE
    try:
        subtree.mkdir(exist_ok=True)
    except OSError:
        return None
    return subtree if (subtree / _V1_PROBE[controller]).exists() else None


@functools.cache
def hierarchies() -> Hierarchies:
    """Find (and prepare, once) the cgroup subtrees this process may use."""
    own = _own_cgroups()
    v2: tuple[Path, frozenset[str]] | None = None
    v1_mounts: dict[str, str] = {}
    for mount, fstype, options in _mounts():
        if fstype == "cgroup2" and v2 is None and "" in own:
            v2 = _setup_v2(Path(mount + own[""].rstrip("/")))
        elif fstype == "cgroup":
            for name in set(options.split(",")) & set(_CONTROLLERS):
                v1_mounts.setdefault(name, mount)
    controllers = v2[1] if v2 else frozenset()
    v1: dict[str, Path] = {}
    for name, mount in v1_mounts.items():
        # Only what v2 cannot bound: one mechanism per limit is enough.
        if name not in controllers and name in own:
            subtree = _setup_v1(mount, own[name], name)
            if subtree is not None:
                v1[name] = subtree
    return Hierarchies(
        v2=v2[0] if v2 else None, v2_controllers=controllers, v1=MappingProxyType(v1)
    )


class CallLimits:
    """The cgroups of one call, created empty before its process exists.

    Named ``<pid of this runner>-<random>``: the workspace is not known yet when a
    launcher is spawned ahead of its call (and cgroup v2 cannot rename), and the owner's
    pid is what tells a dead runner's leftovers (``Hierarchies.orphans``).
    """

    def __init__(self, found: Hierarchies) -> None:
        self.mechanisms = found.mechanisms()
        # (cgroup, its controllers, its version)
        self._groups: list[tuple[Cgroup, frozenset[str], int]] = []
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        by_subtree: dict[Path, set[str]] = {}
        for controller, subtree in found.v1.items():
            by_subtree.setdefault(subtree, set()).add(controller)
        try:
            if found.v2 is not None:
                self._create(Cgroup(found.v2 / name), found.v2_controllers, 2)
            for subtree, controllers in by_subtree.items():
                self._create(Cgroup(subtree / name), frozenset(controllers), 1)
        except OSError as exc:
            self.discard()
            raise SandboxUnavailable(f"limits: cannot create the call's cgroup: {exc}") from exc

    @property
    def cgroups(self) -> list[Cgroup]:
        return [cgroup for cgroup, _, _ in self._groups]

    def _create(self, cgroup: Cgroup, controllers: frozenset[str], version: int) -> None:
        cgroup.path.mkdir()
        self._groups.append((cgroup, controllers, version))

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
        for cgroup, controllers, version in self._groups:
            if version == 2:
                self._apply_v2(cgroup.path, controllers, policy)
            else:
                self._apply_v1(cgroup.path, controllers, policy)
        for which, limit in self._rlimits(policy):
            resource.prlimit(pid, which, (limit, limit))

    @staticmethod
    def _apply_v2(path: Path, controllers: frozenset[str], policy: SandboxPolicy) -> None:
        if "pids" in controllers:
            _write(path / "pids.max", str(policy.pids_max))
        if "memory" in controllers:
            _write(path / "memory.max", str(policy.memory_bytes))
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if (path / name).exists():
                    _write(path / name, value)
        if "cpu" in controllers:
            _write(path / "cpu.max", f"{_cpu_quota_us(policy)} {_CPU_PERIOD_US}")

    @staticmethod
    def _apply_v1(path: Path, controllers: frozenset[str], policy: SandboxPolicy) -> None:
        if "pids" in controllers:
            _write(path / "pids.max", str(policy.pids_max))
        if "memory" in controllers:
            limit = str(policy.memory_bytes)
            # memsw (memory + swap) may never be below the memory limit: set it second.
            _write(path / "memory.limit_in_bytes", limit)
            if (path / "memory.memsw.limit_in_bytes").exists():
                _write(path / "memory.memsw.limit_in_bytes", limit)
            else:  # no swap accounting: at least do not swap the call out to grow
                with contextlib.suppress(OSError):
                    _write(path / "memory.swappiness", "0")
        if "cpu" in controllers:
            _write(path / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(path / "cpu.cfs_quota_us", str(_cpu_quota_us(policy)))

    def _rlimits(self, policy: SandboxPolicy) -> list[tuple[int, int]]:
        plan = [
            (resource.RLIMIT_FSIZE, policy.file_size_bytes),
            (resource.RLIMIT_CORE, 0),
        ]
        if self.mechanisms.memory == "rss-budget":
            plan.append((resource.RLIMIT_AS, policy.memory_bytes))
        if self.mechanisms.cpu == "time-budget":
            plan.append((resource.RLIMIT_CPU, _cpu_seconds(policy)))
        if self.mechanisms.pids == "rlimit":
            plan.append((resource.RLIMIT_NPROC, policy.pids_max))
        return plan

    # -- the runner's watch --------------------------------------------------------

    @property
    def watched(self) -> bool:
        """Whether the call needs the runner's watch (``over``) to enforce a limit."""
        m = self.mechanisms
        return m.memory in ("cgroup1", "rss-budget") or m.cpu == "time-budget"

    @property
    def watch_reads_procfs(self) -> bool:
        """Whether ``over`` reads every process's /proc files (run it in a thread)."""
        return self.mechanisms.memory == "rss-budget" or self.mechanisms.cpu == "time-budget"

    def over(self, policy: SandboxPolicy, root_pid: int) -> str | None:
        """The limit (``"memory"``, ``"cpu_time"``) the call as a whole has run over,
        where no cgroup enforces it on the whole call: then kill the call. ``root_pid``
        is the launcher's (bwrap's) pid, for when no cgroup lists the call's processes.
        """
        m = self.mechanisms
        if self.v1_oom_killed():
            return "memory"  # the kernel killed one process; the call goes with it
        if m.memory != "rss-budget" and m.cpu != "time-budget":
            return None
        pids = self.processes(root_pid)
        if m.memory == "rss-budget" and sum(map(_memory_of, pids)) > policy.memory_bytes:
            return "memory"
        if m.cpu == "time-budget" and sum(map(_cpu_seconds_of, pids)) > _cpu_seconds(policy):
            return "cpu_time"
        return None

    def processes(self, root_pid: int) -> list[int]:
        """The call's processes: from its cgroups (any, even without controllers,
        lists them), else ``root_pid`` and its descendants (a sandbox's orphans are
        re-parented to its pid namespace's init, bwrap's child, so none escapes)."""
        for cgroup in self.cgroups:
            found = cgroup.tree_procs()
            if found:
                return found
        if self.cgroups:
            return []
        return _descendants(root_pid)

    def v1_oom_killed(self) -> bool:
        """Whether v1's memory cgroup killed a process of the call: v1 has no
        ``memory.oom.group``, so the call counts as killed for memory as a whole."""
        return self.mechanisms.memory == "cgroup1" and self._v1_oom_kills() > 0

    def _v1_oom_kills(self) -> int:
        return sum(
            cgroup.counter("memory.oom_control", "oom_kill")
            for cgroup, controllers, version in self._groups
            if version == 1 and "memory" in controllers
        )

    def kill(self) -> None:
        for cgroup in self.cgroups:
            cgroup.kill()

    def events(self) -> tuple[str, ...]:
        """The limits the call ran into."""
        hit = []
        if any(c.counter("pids.events", "max") for c in self.cgroups):
            hit.append("pids")
        if any(c.counter("memory.events", "oom_kill") for c in self.cgroups) or (
            self._v1_oom_kills()
        ):
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


def _cpu_quota_us(policy: SandboxPolicy) -> int:
    return max(1000, int(policy.cpu_quota * _CPU_PERIOD_US))


def _cpu_seconds(policy: SandboxPolicy) -> int:
    """The CPU time a whole call may use where no cgroup sets a rate."""
    return math.ceil(policy.timeout_seconds * policy.cpu_quota) + 1


def _descendants(root: int) -> list[int]:
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        with contextlib.suppress(OSError, ValueError):
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    queue += [int(child) for child in f.read().split()]
    return found


def _memory_of(pid: int) -> int:
    """Bytes of memory ``pid`` holds that it would keep: its proportional share of
    anonymous and shared-memory pages (a fork's copy-on-write pages counted once across
    parent and child; file pages are page cache the kernel can drop)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(_kib_lines(f.read()))
    except (FileNotFoundError, ProcessLookupError):
        return 0
    except OSError:  # no smaps_rollup (before 4.14): resident anonymous + shmem
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(_kib_lines(f.read()))
        except OSError:
            return 0
        return (status.get("RssAnon", 0) + status.get("RssShmem", 0)) * 1024
    if "Pss_Anon" in fields:  # 5.8+
        return (fields["Pss_Anon"] + fields.get("Pss_Shmem", 0)) * 1024
    return fields.get("Pss", 0) * 1024


def _kib_lines(text: str) -> Iterator[tuple[str, int]]:
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        if len(value) == 2 and value[1] == "kB" and value[0].isdigit():
            yield name, int(value[0])


def _cpu_seconds_of(pid: int) -> float:
    """CPU time of ``pid`` and of its children it has reaped (utime, stime, cutime, cstime)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return sum(int(v) for v in fields[11:15]) / _CLOCK_TICKS
