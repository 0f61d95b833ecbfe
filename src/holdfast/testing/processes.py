"""The engine's processes as the harness runs them: one service each, one log each.

A service runs the way ``holdfast up`` and ``compose.yaml`` run it,
``python -m holdfast <service>``, as a direct child (its pid is the one in
its id, ``<host>-<pid>``), with its output appended to a log file of its own.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

Kind = Literal["gateway", "loop-worker", "tool-runner", "learning"]
KINDS: tuple[Kind, ...] = get_args(Kind)


@dataclass(eq=False)
class Process:
    """One service process of an environment."""

    kind: Kind
    name: str  # "<kind>-<n>", also the name of its log file
    popen: subprocess.Popen[bytes]
    log: Path
    url: str | None = None  # a gateway's base URL
    ready: bool = False  # seen ready by the readiness rule

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def ident(self) -> str:
        """The id the service goes by: a loop-worker's consumer name and lease
        owner, a tool-runner's runner id (``<host>-<pid>``)."""
        return f"{socket.gethostname()}-{self.popen.pid}"

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def poll(self) -> int | None:
        """Its exit status, or None while it runs (as ``Popen.poll``)."""
        return self.popen.poll()


def service_command(kind: Kind) -> list[str]:
    return [sys.executable, "-m", "holdfast", kind]


def spawn(command: Sequence[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` with stdout and stderr appended to ``log``."""
    with log.open("ab") as out:  # the child has its own copy of the descriptor
        return subprocess.Popen(
            list(command),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def end(popens: Iterable[subprocess.Popen[bytes]], sig: int, grace: float) -> None:
    """Send ``sig`` to every live one at once, wait up to ``grace`` seconds for
    them all, SIGKILL those still running, and reap every one (no zombie left)."""
    popens = list(popens)
    for popen in popens:
        if popen.poll() is None:
            popen.send_signal(sig)
    deadline = time.monotonic() + grace
    for popen in popens:
        try:
            popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def kill_now(popen: subprocess.Popen[bytes]) -> None:
    end([popen], signal.SIGKILL, grace=0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return "\n".join(text) or "(empty log)"
