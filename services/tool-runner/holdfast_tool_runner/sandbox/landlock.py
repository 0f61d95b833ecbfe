"""Landlock: writes only under the workspace and the sandbox's /tmp.

Landlock has to be applied by the sandboxed process itself, after bubblewrap has
built the mount tree: a Landlock-restricted process may not mount, so it cannot be
applied before bwrap, and bwrap 0.8 has no Landlock option. So bwrap runs a short
shim that restricts itself with the three Landlock syscalls and then execs the
command, which inherits the domain. We ship no compiled helper.

The shim is Perl (``landlock_shim.pl``, run as ``/usr/bin/perl -e``), not Python:

* the engine's own interpreter cannot be used: its virtualenv is outside the
  directories the sandbox can see, so it would be the host's system interpreter;
* Perl's built-in ``syscall()`` makes raw syscalls with no module, where Python
  needs ctypes; measured here, ``perl -e`` costs about 0.6 ms over ``true`` and
  ``python3 -I -S -c 'import ctypes'`` about 8 ms, paid on every tool call;
* ``/usr/bin/perl`` comes with perl-base, which Debian marks Essential (present even
  in slim images); ``python3`` is optional there.

The rules name in-sandbox paths: read and execute on the system directories, full
access to /workspace, /tmp and /dev/shm, read/write (no create) on /dev. With ABI 4
and the network off, TCP bind/connect are denied too; with ABI 6 the process may not
reach abstract unix sockets or signal processes outside its own domain, even when
the network namespace is shared. Landlock also stops the sandbox from ptracing or
reading /proc of anything outside its domain (bwrap's own init included). The shim
reports on a status pipe whether it got that far, so a failure is a
SandboxUnavailable, not a command's exit code.

On a kernel without Landlock (ABI 0) bwrap's read-only mounts and seccomp remain and
``probe()`` says so; where the kernel has it, failing to apply it fails the call.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Sequence
from pathlib import Path

PERL = "/usr/bin/perl"
SHIM_SOURCE = (Path(__file__).parent / "landlock_shim.pl").read_text()

_SYS_LANDLOCK_CREATE_RULESET = 444
_LANDLOCK_CREATE_RULESET_VERSION = 1


@functools.cache
def kernel_abi() -> int:
    """The kernel's Landlock ABI version, 0 if it has none (or it is disabled)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(
        ctypes.c_long(_SYS_LANDLOCK_CREATE_RULESET),
        None,
        ctypes.c_long(0),
        ctypes.c_long(_LANDLOCK_CREATE_RULESET_VERSION),
    )
    if abi < 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EOPNOTSUPP):
            return 0
        raise OSError(err, os.strerror(err))
    return int(abi)


def shim_command(
    *,
    perl: str,
    status_fd: int,
    abi: int,
    deny_tcp: bool,
    read_paths: Sequence[str],
    write_paths: Sequence[str],
    device_paths: Sequence[str],
    command: Sequence[str],
) -> list[str]:
    """The argv bwrap executes: the shim, its arguments, then the command."""
    return [
        perl,
        "-e",
        SHIM_SOURCE,
        "--",
        str(status_fd),
        str(abi),
        "1" if deny_tcp else "0",
        ":".join(read_paths),
        ":".join(write_paths),
        ":".join(device_paths),
        "--",
        *command,
    ]
