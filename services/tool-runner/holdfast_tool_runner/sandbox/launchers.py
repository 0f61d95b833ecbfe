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
from pathlib import Path

from . import bwrap as bw
from . import seccomp
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


class Launcher:
    """One spawned launcher, in its own cgroups, waiting for its command line."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        limits: CallLimits,
        *,
        control: int,
        status_read: int,
        status_fd: int,
        seccomp_fds: dict[bool, int],
        etc_fds: dict[str, int],
    ) -> None:
        self.process = process
        self.limits = limits
        self.status_read = status_read  # ours; the others are fd numbers in the launcher
        self.status_fd = status_fd
        self.etc_fds = etc_fds
        self._seccomp_fds = seccomp_fds
        self._control: int | None = control

    @classmethod
    async def spawn(cls, perl: str, limits: CallLimits) -> Launcher:
        """Start a launcher and move it into ``limits``' cgroups (which it then owns)."""
        ours: list[int] = []
        theirs: list[int] = []
        try:
            control_read, control = os.pipe()
            ours.append(control)
            theirs.append(control_read)
            with contextlib.suppress(OSError):  # a smaller pipe is only slower for huge calls
                fcntl.fcntl(control, fcntl.F_SETPIPE_SZ, _CONTROL_PIPE_BYTES)
            status_read, status_fd = os.pipe()
            ours.append(status_read)
            theirs.append(status_fd)
            seccomp_fds = {net: seccomp.program_fd(network=net) for net in (False, True)}
            theirs.extend(seccomp_fds.values())
            etc_fds = {path: _pipe_with(data) for path, data in bw.generated_etc().items()}
            theirs.extend(etc_fds.values())
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
            for fd in ours:
                os.close(fd)
            limits.discard()
            if isinstance(exc, OSError):
                raise SandboxUnavailable(f"cannot start the sandbox launcher: {exc}") from exc
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        launcher = cls(
            process,
            limits,
            control=control,
            status_read=status_read,
            status_fd=status_fd,
            seccomp_fds=seccomp_fds,
            etc_fds=etc_fds,
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

    def seccomp_fd(self, *, network: bool) -> int:
        return self._seccomp_fds[network]

    async def launch(self, policy: SandboxPolicy, argv: list[str]) -> None:
        """Apply ``policy``'s limits and execute ``argv`` (bwrap's) in the launcher."""
        if any("\0" in arg for arg in argv):
            raise ValueError("embedded null byte in the command line")
        if self._control is None:
            raise SandboxUnavailable("sandbox launcher already used")
        self.limits.apply(policy, self.process.pid)
        unused = str(self._seccomp_fds[not policy.network])
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
        with contextlib.suppress(OSError):
            os.close(self.status_read)
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

    async def __aenter__(self) -> Launchers:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
