"""A sandboxed process that stays: an MCP stdio server, talked to over its pipes.

``run_sandboxed`` runs a command to its end and returns what it printed; an MCP
stdio server instead lives as long as its session, reading requests on stdin and
answering on stdout. It starts the same way (a launcher, the same bwrap +
seccomp + Landlock + limits: runner.py's ``_launch``) and is registered for the
same watchdog, so ``reap_leftovers`` at the end of its task's turn kills it too.

Its environment (an API key the server needs, say) is never put on a command
line, where any host user could read it in /proc: a small Perl prelude reads it
from the first line of stdin (``KEY=<hex of value>`` pairs), sets it, and
executes the server with the rest of stdin untouched (it reads that line one
byte at a time, so nothing of the server's input is consumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Mapping

from .launchers import Launchers
from .policy import SandboxPolicy, SandboxUnavailable
from .runner import Host, _forget, _launch, _Launched, default_host

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STOP_GRACE_SECONDS = 2.0
# Reads "K=hex K=hex\n" from stdin byte by byte, sets the environment, executes the
# command (PATH-searched, as a shell would).
_ENV_PRELUDE = r"""
my ($line, $c) = ('', '');
while (sysread(STDIN, $c, 1)) { last if $c eq "\n"; $line .= $c; }
for my $pair (split / /, $line) {
    my ($k, $v) = split /=/, $pair, 2;
    $ENV{$k} = pack("H*", $v // "");
}
exec { $ARGV[0] } @ARGV or die "cannot execute $ARGV[0]: $!\n";
"""


def env_line(env: Mapping[str, str]) -> bytes:
    """The prelude's first line for ``env`` (names checked, values hex-encoded)."""
    for name in env:
        if not ENV_NAME.match(name):
            raise ValueError(f"not an environment variable name: {name!r}")
    return " ".join(f"{k}={v.encode().hex()}" for k, v in env.items()).encode() + b"\n"


class Resident:
    """A running sandboxed process with its pipes: ``stdin`` to write, ``stdout``
    and ``stderr`` to read. :meth:`stop` kills it and releases its sandbox."""

    def __init__(self, launched: _Launched, launchers: Launchers | None) -> None:
        self._launched = launched
        self._launchers = launchers
        process = launched.launcher.process
        assert process.stdin is not None and process.stdout is not None
        assert process.stderr is not None
        self.process = process
        self.stdin: asyncio.StreamWriter = process.stdin
        self.stdout: asyncio.StreamReader = process.stdout
        self.stderr: asyncio.StreamReader = process.stderr
        self._stopped = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def handle(self) -> object:
        """What ``reap_leftovers(..., sparing=...)`` knows it by."""
        return self._launched.call

    @property
    def alive(self) -> bool:
        """Neither stopped, nor reaped, nor exited."""
        return not self._stopped and not self.reaped and self.process.returncode is None

    @property
    def reaped(self) -> bool:
        """Whether the turn-end watchdog killed it."""
        return self._launched.call.reaped

    async def stop(self) -> None:
        """Kill it (and everything it started) and release its sandbox; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        launched = self._launched
        with contextlib.suppress(OSError):
            self.stdin.close()
        launched.call.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.process.wait(), _STOP_GRACE_SECONDS)
        if launched.uplink is not None:
            launched.uplink.close()
        await launched.call.limits.release()
        _forget(launched.tag, launched.call)
        if self._launchers is not None:
            self._launchers.refill()
        launched.launcher.close_ours()


async def start_resident(
    argv: list[str],
    policy: SandboxPolicy,
    *,
    env: Mapping[str, str] | None = None,
    launchers: Launchers | None = None,
    host: Host | None = None,
) -> Resident:
    """Start ``argv`` in the sandbox of ``policy`` with ``env`` added to its
    environment, and return it running. Raises SandboxUnavailable (nothing runs)
    if the sandbox cannot be set up; the process's own failures show as its exit."""
    if not argv:
        raise ValueError("argv is empty")
    if any("\0" in arg for arg in argv):
        raise ValueError("embedded null byte in the command line")
    line = env_line(env or {})
    found = host or default_host()
    launched = await _launch(
        [found.perl, "-e", _ENV_PRELUDE, "--", *argv], policy, launchers=launchers, found=found
    )
    resident = Resident(launched, launchers)
    os.set_blocking(launched.launcher.status_read, False)
    try:
        resident.stdin.write(line)
        await resident.stdin.drain()
    except (BrokenPipeError, ConnectionResetError) as exc:
        await resident.stop()
        raise SandboxUnavailable(f"the sandboxed process exited at once: {exc}") from exc
    return resident
