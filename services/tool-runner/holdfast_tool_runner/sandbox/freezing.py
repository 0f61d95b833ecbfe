"""Hold a task's processes still while its workspace is archived.

A checkpoint takes the task's lock, so no tool call runs meanwhile; but a process
of the task can outlive its call: a stdio MCP server lives across calls and turns
(``resident.py``). While one runs it can change the workspace under the archiver
(security issue #23: it flipped a directory to a symlink to a host path). The
archiver itself never follows a symlink (``workspace_tree.py``); this is
the second layer: nothing of the task moves during a checkpoint, so the archive is
a consistent snapshot.

How: a call's cgroup v2 is frozen (``cgroup.freeze``: the kernel stops every process
in it at once, and none forks out of it). Without one, every process of the call
(its cgroups' lists, else bwrap's descendants) gets SIGSTOP, round after round
until a round finds none that has not stopped; SIGCONT lets them go. A call that
will not hold still within the bounds is killed instead (``killed_reason="reaped"``):
it is never archived while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

from .limits import Cgroup
from .runner import _Call, _running, workspace_tag

log = logging.getLogger(__name__)

# Long enough for a process in uninterruptible sleep (disk I/O) to come out of it.
_HOLD_STILL_SECONDS = 2.0
_POLL_SECONDS = 0.002
# /proc/<pid>/stat states of a process that runs no more code.
_STILL = frozenset("TtZX")


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # "pid (comm) S ...": comm may hold spaces and parentheses.
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None  # gone


def _v2_cgroups(call: _Call) -> list[Cgroup]:
    return [c for c in call.limits.cgroups if (c.path / "cgroup.freeze").exists()]


def _frozen_v2(cgroup: Cgroup) -> bool:
    return cgroup.counter("cgroup.events", "frozen") == 1


class _Held:
    """One call, stopped by :meth:`stop` (blocking: run in a thread) until :meth:`go_on`."""

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.cgroups = _v2_cgroups(call)
        self.signalled: set[int] = set()

    def stop(self) -> bool:
        """Whether every process of the call stopped in time."""
        deadline = time.monotonic() + _HOLD_STILL_SECONDS
        if self.cgroups:
            for cgroup in self.cgroups:
                with contextlib.suppress(FileNotFoundError):
                    (cgroup.path / "cgroup.freeze").write_text("1")
            while not all(_frozen_v2(c) or not c.path.exists() for c in self.cgroups):
                if time.monotonic() > deadline:
                    return False
                time.sleep(_POLL_SECONDS)
            return True
        process = self.call.process
        if process is None:
            return True
        while True:
            moving = [
                pid
                for pid in self.call.limits.processes(process.pid)
                if (state := _state(pid)) is not None and state not in _STILL
            ]
            if not moving:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in moving:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    self.signalled.add(pid)
            time.sleep(_POLL_SECONDS)

    def go_on(self) -> None:
        for cgroup in self.cgroups:
            with contextlib.suppress(FileNotFoundError):
                (cgroup.path / "cgroup.freeze").write_text("0")
        for pid in self.signalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@contextlib.asynccontextmanager
async def frozen(workspace: Path) -> AsyncIterator[int]:
    """Stop every process this runner runs for ``workspace`` (its calls and stdio
    servers) until the block ends, then let them go on; yields how many calls it
    holds. A call that does not stop in time is killed (reaped) instead."""
    tag = workspace_tag(await asyncio.to_thread(workspace.resolve))
    held: list[_Held] = []
    try:
        for call in list(_running.get(tag, ())):
            one = _Held(call)
            held.append(one)
            if not await asyncio.to_thread(one.stop):
                log.warning("a process of workspace %s would not stop; killing it", workspace)
                call.reaped = True
                call.kill()
        yield len(held)
    finally:
        for one in held:
            one.go_on()
