"""Sandboxed calls' processes, started ahead of the calls that will use them.

Moving a process into a cgroup is slow: the kernel takes the cgroup threadgroup lock
for writing, which waits for an RCU grace period, 10-15 ms on a quiet host (a move
right after another is fast). ``clone3(CLONE_INTO_CGROUP)`` would avoid the move,
but only on cgroup v2 (hybrid hosts keep pids in v1) and not from Python. So the
move is made before the call, off its path:

* a **launcher** is a small Perl program (``launcher.pl``; Perl for the reasons in
  landlock.py) spawned with the call's pipes (stdin, stdout, stderr, the shim's
  status pipe), both seccomp programs and the generated /etc files as inherited
  fds, moved into a fresh call's cgroups from a worker thread, and then waiting on
  a control pipe;
* a call takes a ready launcher, sets the policy's limits on it (cgroup files,
  ``prlimit``), and writes bwrap's command line to the control pipe: the launcher
  closes the fds the call does not use and executes bwrap, inside its cgroups;
* ``Launchers`` keeps a few spares and refills in the background once a call is
  done (a move that waits for its grace period holds up every fork on the host,
  so it is kept out of a starting call's way); without a pool, or with it empty,
  a call spawns its own launcher and waits for the move.

The spawn itself uses no ``preexec_fn``, so Python's subprocess can use vfork, and
the process is spawned from the event loop's thread (bwrap's ``--die-with-parent``
follows the thread that forked it). A launcher whose control pipe reaches EOF
without a complete message (the runner closed the pool, or died) exits without
running anything.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from . import bwrap as bw
from . import network, seccomp
from .limits import CallLimits, Hierarchies
from .policy import SandboxPolicy, SandboxUnavailable

log = logging.getLogger(__name__)

LAUNCHER_SOURCE = (Path(__file__).parent / "launcher.pl").read_text()
# Room for the longest command line exec accepts in one argument (MAX_ARG_STRLEN,
# 128 KiB) and bwrap's own; 1 MiB is the default limit an unprivileged process may ask.
_CONTROL_PIPE_BYTES = 1 << 20
_EXIT_GRACE_SECONDS = 2.0


def _pipe_with(data: bytes) -> int:
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, data)  # small: fits the pipe buffer
    finally:
        os.close(write_end)
    return read_end


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@dataclass(frozen=True)
class ChildFds:
    """The fds a launcher inherits, by number in the launcher (and then in bwrap)."""

    status: int  # the Landlock shim's report
    seccomp: dict[bool, int]  # the filter program, by whether the network is allowed
    etc: dict[str, int]  # generated /etc files, by in-sandbox path
    resolv_conf: int  # /etc/resolv.conf for a sandbox behind slirp4netns
    info: int  # bwrap --info-fd: where it reports the sandbox's pid
    block: int  # bwrap --block-fd: holds the command until the network is up

    def all(self) -> set[int]:
        return {
            self.status,
            *self.seccomp.values(),
            *self.etc.values(),
            self.resolv_conf,
            self.info,
            self.block,
        }


class Launcher:
    """One spawned launcher, in its own cgroups, waiting for its command line.

    ``child`` names the fds it holds for bwrap; ours are the other ends of its pipes:
    ``status_read``, ``info_read``, ``block_write``.
    """

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        limits: CallLimits,
        child: ChildFds,
        *,
        control: int,
        status_read: int,
        info_read: int,
        block_write: int,
    ) -> None:
        self.process = process
        self.limits = limits
        self.child = child
        self.status_read = status_read
        self.info_read = info_read
        self.block_write = block_write
        self._control: int | None = control

    @classmethod
    async def spawn(cls, perl: str, limits: CallLimits) -> Launcher:
        """Start a launcher and move it into ``limits``' cgroups (which it then owns)."""
        made: list[int] = []  # closed if the spawn fails

        def track(fd: int) -> int:
            made.append(fd)
            return fd

        def pipe() -> tuple[int, int]:
            read_end, write_end = os.pipe()
            return track(read_end), track(write_end)

        try:
            control_read, control = pipe()
            with contextlib.suppress(OSError):  # a smaller pipe is only slower for huge calls
                fcntl.fcntl(control, fcntl.F_SETPIPE_SZ, _CONTROL_PIPE_BYTES)
            status_read, status_write = pipe()
            info_read, info_write = pipe()
            block_read, block_write = pipe()
            child = ChildFds(
                status=status_write,
                seccomp={net: track(seccomp.program_fd(network=net)) for net in (False, True)},
                etc={path: track(_pipe_with(data)) for path, data in bw.generated_etc().items()},
                resolv_conf=track(_pipe_with(network.RESOLV_CONF)),
                info=info_write,
                block=block_read,
            )
            theirs = [control_read, *child.all()]
            process = await asyncio.create_subprocess_exec(
                perl,
                "-e",
                LAUNCHER_SOURCE,
                str(control_read),
                # Always a pipe, never the host's /dev/null: an inherited host inode
                # could be fchmod-ed by the sandbox (see bwrap.py).
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=theirs,
                start_new_session=True,
                env={"PATH": "/usr/bin:/bin"},
            )
        except BaseException as exc:
            for fd in made:
                os.close(fd)
            limits.discard()
            if isinstance(exc, OSError):
                raise SandboxUnavailable(f"cannot start the sandbox launcher: {exc}") from exc
            raise
        for fd in theirs:  # the launcher has its own copies
            os.close(fd)
        launcher = cls(
            process,
            limits,
            child,
            control=control,
            status_read=status_read,
            info_read=info_read,
            block_write=block_write,
        )
        joining = asyncio.ensure_future(asyncio.to_thread(limits.join, process.pid))
        try:
            # Shielded: a cancelled spawn still waits for the move before cleaning up.
            await asyncio.shield(joining)
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                await joining
            await launcher.discard()
            if isinstance(exc, OSError):
                raise SandboxUnavailable(f"limits: cannot join the call's cgroup: {exc}") from exc
            raise
        return launcher

    @property
    def alive(self) -> bool:
        return self.process.returncode is None and self._control is not None

    async def launch(self, policy: SandboxPolicy, argv: list[str], uses: set[int]) -> None:
        """Apply ``policy``'s limits and execute ``argv`` (bwrap's) in the launcher,
        which first closes the fds of ``child`` not in ``uses``. ``argv`` holds no NUL
        (``run_sandboxed`` checks the command's)."""
        if self._control is None:
            raise SandboxUnavailable("sandbox launcher already used")
        try:
            self.limits.apply(policy, self.process.pid)
        except OSError as exc:  # ProcessLookupError: the launcher died waiting
            raise SandboxUnavailable(f"limits: cannot apply the call's limits: {exc}") from exc
        unused = ",".join(str(fd) for fd in sorted(self.child.all() - uses))
        message = b"".join(f.encode() + b"\0" for f in (unused, *argv, "END"))
        control, self._control = self._control, None
        try:
            if len(message) <= fcntl.fcntl(control, fcntl.F_GETPIPE_SZ):
                os.write(control, message)  # an empty pipe takes it whole
            else:
                await asyncio.to_thread(_write_all, control, message)
        except OSError as exc:  # BrokenPipeError: the launcher died waiting
            raise SandboxUnavailable(f"sandbox launcher gone: {exc}") from exc
        finally:
            os.close(control)

    def close_ours(self) -> None:
        """Close our ends of the call's pipes (after the call, or when discarding)."""
        for name in ("status_read", "info_read", "block_write"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    async def discard(self) -> None:
        """Stop a launcher that will not be used (or whose call failed before it ran)."""
        if self._control is not None:
            os.close(self._control)  # EOF: it exits without running anything
            self._control = None
        self.limits.kill()
        # Not process.kill(): Popen polls first and so reaps the child behind asyncio's
        # child watcher. Until asyncio has seen it exit, the pid is still this child's.
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.communicate(), _EXIT_GRACE_SECONDS)
        self.close_ours()
        await self.limits.release()


class Launchers:
    """A few launchers spawned ahead of the calls that will use them.

    Bound to the event loop that uses it; ``aclose()`` stops the spares.
    """

    def __init__(self, perl: str, cgroups: Hierarchies, *, spares: int) -> None:
        self._perl = perl
        self._cgroups = cgroups
        self.spares = max(0, spares)
        self._ready: collections.deque[Launcher] = collections.deque()
        self._filler: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def ready(self) -> int:
        return len(self._ready)

    async def spawn(self) -> Launcher:
        """A new launcher, moved into fresh cgroups (waits for the move)."""
        return await Launcher.spawn(self._perl, CallLimits(self._cgroups))

    def start(self) -> None:
        """Begin filling the pool (calls spawn their own until it has some)."""
        self._refill()

    async def take(self) -> Launcher:
        """A ready launcher, or a new one if none is. Call ``refill`` once the call is done."""
        while self._ready:
            launcher = self._ready.popleft()
            if launcher.alive:
                return launcher
            await launcher.discard()
        return await self.spawn()

    def refill(self) -> None:
        """Spawn spares up to the pool's size, in the background.

        Called after a call, not when it takes a launcher: while a move into a cgroup
        waits for its grace period, every fork on the host waits with it, bwrap's too.
        """
        self._refill()

    def _refill(self) -> None:
        if self._closed or self.spares == 0:
            return
        if self._filler is None or self._filler.done():
            self._filler = asyncio.create_task(self._fill(), name="sandbox-launchers")

    async def _fill(self) -> None:
        while not self._closed and len(self._ready) < self.spares:
            try:
                launcher = await self.spawn()
            except SandboxUnavailable as exc:
                # The next call spawns its own and reports the same error to its caller.
                log.warning("cannot keep a spare sandbox launcher: %s", exc)
                return
            if self._closed:
                await launcher.discard()
                return
            self._ready.append(launcher)

    async def aclose(self) -> None:
        self._closed = True
        if self._filler is not None:
            self._filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filler
        while self._ready:
            await self._ready.popleft().discard()
        await network.settle()

    async def __aenter__(self) -> Launchers:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
