"""Run one command in the sandbox, and clean up after a task's turn.

A call: check the host once (bwrap, perl, Landlock ABI, seccomp program,
cgroups), take a launcher (a process already in the call's own cgroups, spawned
ahead of the call: launchers.py), set the policy's limits on it and have it
execute ``bwrap ... -- perl shim ... -- argv`` as a new session, read
stdout/stderr up to the cap (discarding the rest so the command never blocks on a
full pipe), and on the wall-clock timeout kill everything: ``cgroup.kill``, the
session's process group, and bwrap's pid namespace, whose processes the kernel
kills when bwrap's init exits. Where no cgroup enforces the memory or CPU limit on
the call as a whole, a watch polls the call (``CallLimits.over``) and kills all of
it once the call is over its limit. The result is trusted only if the shim reported
that the sandbox was fully set up; otherwise ``SandboxUnavailable`` says why and
nothing ran unsandboxed.

Leftovers: a process a command leaves in the background dies with the call's pid
namespace when the command exits. ``reap_leftovers(workspace)`` is the turn-end
watchdog on top of that: it kills every call still running for that workspace in
this process and every call cgroup left behind by a runner that crashed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import signal
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from . import bwrap as bw
from . import landlock, network, seccomp
from .launchers import Launcher, Launchers
from .limits import WATCH_SECONDS, CallLimits, Hierarchies, hierarchies
from .policy import SandboxPolicy, SandboxResult, SandboxUnavailable

log = logging.getLogger(__name__)

_KILL_GRACE_SECONDS = 2.0
# A sandbox with a network is set up by bwrap (its loopback) and slirp4netns
# (its uplink) in the same new namespace; on a busy host bwrap's loopback set-up
# now and then fails ("loopback: Failed RTM_NEWADDR") or bwrap exits before the
# uplink is up — about one run of tests/sandbox/test_run.py in four while other
# sandboxes start. Nothing has run then, so the set-up is tried again.
SETUP_ATTEMPTS = 3
_READ_CHUNK = 64 * 1024
_SYSTEM_DIRS = ("/usr", "/etc", "/proc", "/sys", "/dev", "/bin", "/sbin", "/lib", "/lib64", "/boot")


@dataclass(frozen=True)
class Host:
    """What this host offers the sandbox: found by :meth:`discover`, then passed in.

    ``run_sandboxed`` and ``launcher_pool`` take one (``host=``), so a caller
    (and a test) can hand in other facts — a missing tool, a kernel without
    Landlock — without patching anything; without one they use
    :func:`default_host`, discovered once per process.
    """

    bwrap: str
    perl: str
    landlock_abi: int
    cgroups: Hierarchies
    private_devices: Path | None
    slirp4netns: str | None = None  # None: a sandbox with network shares the host's

    @classmethod
    def discover(cls, *, path: str | None = None) -> Host:
        """Look at this host (``path``: where to look for ``bwrap``, default
        ``$PATH``); raises SandboxUnavailable naming what is missing."""
        found = shutil.which("bwrap", path=path)
        if found is None:
            raise SandboxUnavailable(
                "bwrap: bubblewrap is not installed (apt-get install bubblewrap)"
            )
        if not os.access(landlock.PERL, os.X_OK):
            raise SandboxUnavailable(
                f"landlock: {landlock.PERL} is missing; the in-sandbox shim needs it "
                "(Debian: perl-base, which is Essential)"
            )
        try:
            abi = landlock.kernel_abi()
        except OSError as exc:
            raise SandboxUnavailable(f"landlock: cannot query the kernel: {exc}") from exc
        for allowed in (False, True):
            seccomp.filter_program(network=allowed)
        found_cgroups = hierarchies()
        found_cgroups.mechanisms()  # fails closed if processes cannot be bounded
        devices = bw.private_devices() if os.geteuid() == 0 else None
        return cls(found, landlock.PERL, abi, found_cgroups, devices, network.slirp4netns())


@functools.cache
def default_host() -> Host:
    """This host, discovered on first use. Not cached when it raises: a host
    fixed later (bwrap installed) is picked up by the next call."""
    return Host.discover()


def _network_mode(policy: SandboxPolicy, found: Host) -> str:
    if not policy.network:
        return "none"
    return "slirp4netns" if found.slirp4netns else "host"


def workspace_tag(workspace: Path) -> str:
    return hashlib.sha256(str(workspace).encode()).hexdigest()[:16]


def _check_workspace(workspace: Path) -> Path:
    try:
        resolved = workspace.resolve(strict=True)
    except OSError as exc:
        raise SandboxUnavailable(f"workspace {workspace}: {exc.strerror}") from exc
    if not resolved.is_dir():
        raise SandboxUnavailable(f"workspace {workspace} is not a directory")
    if resolved == Path("/") or any(
        resolved == Path(d) or Path(d) in resolved.parents for d in _SYSTEM_DIRS
    ):
        raise SandboxUnavailable(f"workspace {resolved} is (inside) a system directory")
    if os.geteuid() == 0 and not any(_closed_to_others(p) for p in resolved.parents):
        # Files the sandbox creates are owned by root on the host and it may set their
        # setuid bit; no other host user may be able to reach them. (Not the workspace
        # itself: the sandbox owns it and could chmod it open.)
        raise SandboxUnavailable(
            f"workspace {resolved}: no parent directory is closed to other users "
            "(owned by root, not searchable by others, e.g. mode 0700); put workspaces under one"
        )
    return resolved


def _closed_to_others(directory: Path) -> bool:
    st = directory.stat()
    group_ok = st.st_gid == 0 or not st.st_mode & stat.S_IXGRP
    return st.st_uid == 0 and not st.st_mode & stat.S_IXOTH and group_ok


class _Capture:
    """One output stream, kept up to ``cap`` bytes; the rest is read and dropped."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.truncated = False

    async def pump(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            room = self.cap - len(self.data)
            if len(chunk) > room:
                self.truncated = True
            if room > 0:
                self.data += chunk[:room]

    def text(self) -> str:
        text = self.data.decode("utf-8", errors="replace")
        if self.truncated:
            text += f"\n[... output truncated at {self.cap} bytes]"
        return text


class _Call:
    """A call, registered from before its spawn so the turn-end watchdog can find it."""

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        self.process: asyncio.subprocess.Process | None = None
        self.reaped = False
        self.over: str | None = None  # the per-call limit the watch killed it for

    def kill(self) -> None:
        self.limits.kill()
        # Only while not waited for: until then the process group id is still ours.
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


_running: dict[str, set[_Call]] = {}


def _forget(tag: str, call: _Call) -> None:
    calls = _running.get(tag, set())
    calls.discard(call)
    if not calls:
        _running.pop(tag, None)


def _killed_reason(code: int, events: tuple[str, ...]) -> str | None:
    if code < 0:  # bwrap itself was killed (the memory cgroup's OOM takes the group)
        sig = -code
    elif code > 128:  # bwrap reports a command killed by signal N as 128 + N
        sig = code - 128
    else:
        return None
    if sig == signal.SIGKILL and "memory" in events:
        return "memory"
    if sig == signal.SIGXFSZ:
        return "file_size"
    if sig == signal.SIGXCPU:
        return "cpu_time"
    try:
        return f"signal:{signal.Signals(sig).name}"
    except ValueError:
        return None


async def _watch(call: _Call, policy: SandboxPolicy, root_pid: int) -> None:
    """Kill the call once it is over a limit no cgroup enforces on it as a whole."""
    limits = call.limits
    while True:
        await asyncio.sleep(WATCH_SECONDS)
        if limits.watch_reads_procfs:  # a few /proc files per process: off the loop
            over = await asyncio.to_thread(limits.over, policy, root_pid)
        else:
            over = limits.over(policy, root_pid)
        if over is not None:
            call.over = over
            call.kill()
            return


async def _feed(stdin: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        stdin.write(data)
        await stdin.drain()
    stdin.close()


def launcher_pool(*, spares: int, host: Host | None = None) -> Launchers:
    """A pool of ``spares`` launchers for ``run_sandboxed`` on ``host`` (see launchers.py)."""
    found = host or default_host()
    return Launchers(found.perl, found.cgroups, spares=spares)


@dataclass
class _Launched:
    """A command started in the sandbox: its call (registered for the watchdog), the
    launcher whose process it is, the network uplink if any."""

    call: _Call
    launcher: Launcher
    uplink: network.Uplink | None
    tag: str
    started: float


async def _launch(
    argv: list[str], policy: SandboxPolicy, *, launchers: Launchers | None, found: Host
) -> _Launched:
    """Take (or spawn) a launcher and have it execute ``argv`` in the sandbox of
    ``policy``; on failure nothing runs and the launcher is discarded."""
    workspace = _check_workspace(policy.workspace)
    tag = workspace_tag(workspace)
    if launchers is not None:
        launcher = await launchers.take()
    else:
        launcher = await Launcher.spawn(found.perl, CallLimits(found.cgroups))
    call = _Call(launcher.limits)
    call.process = launcher.process
    _running.setdefault(tag, set()).add(call)
    child = launcher.child
    isolated = policy.network and found.slirp4netns is not None
    uses = {child.status, child.seccomp[policy.network], *child.etc.values()}
    etc_fds = dict(child.etc)
    if isolated:
        uses |= {child.info, child.block, child.resolv_conf}
        etc_fds["/etc/resolv.conf"] = child.resolv_conf
    uplink: network.Uplink | None = None
    try:
        inner = landlock.shim_command(
            perl=found.perl,
            status_fd=child.status,
            abi=found.landlock_abi,
            deny_tcp=not policy.network,
            read_paths=(*bw.READ_PATHS, *(str(p) for p in policy.read_only_paths)),
            write_paths=bw.WRITE_PATHS,
            device_paths=bw.DEVICE_PATHS,
            command=argv,
        )
        args = bw.bwrap_argv(
            found.bwrap,
            policy,
            workspace,
            seccomp_fd=child.seccomp[policy.network],
            etc_fds=etc_fds,
            devices=found.private_devices,
            command=inner,
            uplink_fds=(child.info, child.block) if isolated else None,
        )
        started = time.monotonic()
        await launcher.launch(policy, args, uses)
        if isolated:
            assert found.slirp4netns is not None
            uplink = await network.Uplink.connect(
                found.slirp4netns, launcher.info_read, launcher.block_write
            )
    except BaseException:
        _forget(tag, call)
        await launcher.discard()
        if launchers is not None:
            launchers.refill()
        raise
    return _Launched(call, launcher, uplink, tag, started)


async def run_sandboxed(
    argv: list[str],
    policy: SandboxPolicy,
    *,
    stdin: bytes | None = None,
    launchers: Launchers | None = None,
    host: Host | None = None,
) -> SandboxResult:
    """Run ``argv`` in the sandbox described by ``policy`` and report what happened.

    The command runs in /workspace (the policy's workspace) with ``stdin`` (or an
    empty stdin), a scrubbed environment, and the policy's limits. Never raises for
    anything the command does; raises SandboxUnavailable, without running anything,
    if the sandbox cannot be set up. With ``launchers``, the call starts from a
    launcher spawned ahead of it; without, it spawns its own first. ``host``: the
    facilities to use (default: :func:`default_host`).
    """
    if not argv:
        raise ValueError("argv is empty")
    if any("\0" in arg for arg in argv):
        raise ValueError("embedded null byte in the command line")
    found = host or default_host()
    for attempt in range(1, SETUP_ATTEMPTS + 1):
        try:
            return await _run(argv, policy, stdin, launchers, found)
        except SandboxUnavailable as exc:
            if not exc.transient or attempt == SETUP_ATTEMPTS:
                raise
            log.info("sandbox set-up failed (%s), attempt %d: trying again", exc, attempt)
    raise AssertionError("unreachable")


async def _run(
    argv: list[str],
    policy: SandboxPolicy,
    stdin: bytes | None,
    launchers: Launchers | None,
    found: Host,
) -> SandboxResult:
    launched = await _launch(argv, policy, launchers=launchers, found=found)
    call, launcher, uplink, tag, started = (
        launched.call,
        launched.launcher,
        launched.uplink,
        launched.tag,
        launched.started,
    )
    process = launcher.process
    status_read = launcher.status_read
    os.set_blocking(status_read, False)

    if call.reaped:  # reaped while launching
        call.kill()
    out, err = _Capture(policy.max_output_bytes), _Capture(policy.max_output_bytes)
    assert process.stdout is not None and process.stderr is not None and process.stdin
    pumps = [
        asyncio.create_task(out.pump(process.stdout)),
        asyncio.create_task(err.pump(process.stderr)),
    ]
    feeder = asyncio.create_task(_feed(process.stdin, stdin or b""))
    watch = asyncio.create_task(_watch(call, policy, process.pid)) if call.limits.watched else None
    timed_out = False
    duration_ms = 0.0
    try:
        try:
            async with asyncio.timeout(policy.timeout_seconds):
                await process.wait()
                await asyncio.gather(*pumps)
        except TimeoutError:
            timed_out = True
        duration_ms = (time.monotonic() - started) * 1000
    finally:
        if watch is not None:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        call.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), _KILL_GRACE_SECONDS)
        _, pending = await asyncio.wait([*pumps, feeder], timeout=_KILL_GRACE_SECONDS)
        for task in pending:  # only if something outside the sandbox holds a pipe
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if uplink is not None:
            uplink.close()
        events = call.limits.events()
        if call.over is None and call.limits.v1_oom_killed():
            # The kernel killed a process and the rest ended before the watch's next
            # look: the call still goes as v2's memory.oom.group would take it.
            call.over = "memory"
        if call.over is not None and call.over not in events:
            events += (call.over,)
        await call.limits.release()
        _forget(tag, call)
        if launchers is not None:
            launchers.refill()
        try:
            status = os.read(status_read, 4096)
        except BlockingIOError:
            status = b""
        launcher.close_ours()

    code = process.returncode
    if call.reaped:
        reason: str | None = "reaped"
    elif timed_out:
        reason = "timeout"
    else:
        if not status.startswith(b"K"):
            detail = status[1:].decode(errors="replace") or err.text().strip()
            raise SandboxUnavailable(
                f"sandbox set-up failed: {detail or f'exit {code}'}",
                transient=policy.network and "loopback" in detail,
            )
        if call.over is not None:
            reason = call.over
        else:
            reason = _killed_reason(code if code is not None else -signal.SIGKILL, events)
    # Killed from outside, every process at once: no exit code of the command's own.
    killed_whole = reason in ("timeout", "reaped") or call.over is not None
    return SandboxResult(
        exit_code=None if killed_whole or code is None or code < 0 else code,
        stdout=out.text(),
        stderr=err.text(),
        truncated=out.truncated or err.truncated,
        timed_out=timed_out,
        killed_reason=reason,
        duration_ms=duration_ms,
        limit_events=events,
        mechanisms=MappingProxyType(
            {**call.limits.mechanisms.as_dict(), "network": _network_mode(policy, found)}
        ),
    )


async def reap_leftovers(workspace: Path, *, sparing: Collection[object] = ()) -> int:
    """Turn-end watchdog: kill everything still running for ``workspace``.

    Kills the calls this process is running for it (they return with
    ``killed_reason="reaped"``) but those in ``sparing`` (``Resident.handle``: the
    stdio MCP servers a task keeps between its turns), and every call cgroup left
    by a runner process that has since died, whatever its workspace (a call's
    cgroups are named after the runner, not the workspace: see limits.py).
    Returns how many calls or cgroups it found.
    """
    tag = workspace_tag(await asyncio.to_thread(workspace.resolve))
    calls = [call for call in _running.get(tag, ()) if call not in sparing]
    for call in calls:
        call.reaped = True
        call.kill()
    try:
        orphans = list(default_host().cgroups.orphans())
    except SandboxUnavailable:
        orphans = []
    for cgroup in orphans:
        await cgroup.remove()
    return len(calls) + len(orphans)
