"""The seccomp filter every sandboxed process runs under.

Built with libseccomp and exported as a BPF program that bubblewrap loads with
``--seccomp FD`` right before it executes the command, after it has finished its
own mounts and namespace set-up. libseccomp is reached through a five-function
ctypes binding below rather than the ``pyseccomp`` package: that needs no Python
dependency (only Debian's libseccomp2), and fails loudly on an unknown syscall name
where pyseccomp's resolver returns -1 silently.

Default allow; these fail with EPERM:

* debugging and reading other processes: ptrace, process_vm_readv/writev, pidfd_getfd;
* io_uring (its own syscall surface, a frequent source of kernel bugs);
* kernel keyrings, bpf, perf_event_open, userfaultfd;
* namespaces and mounts: mount, umount2, the new mount API, pivot_root, unshare,
  setns, and clone with any CLONE_NEW* flag (clone3 answers ENOSYS, as under Docker,
  because its flags sit behind a pointer that seccomp cannot read; libc falls back
  to clone);
* ioctl TIOCSTI / TIOCLINUX (push input into a terminal), compared on the low 32
  bits of the request because the kernel ignores the high ones;
* with the network off, socket() for any family but AF_UNIX;
* setting a setuid or setgid bit: chmod, fchmod, fchmodat(2), mknod(at), creat, and
  open/openat with O_CREAT or O_TMPFILE, whose mode has S_ISUID or S_ISGID. A file the
  sandbox makes is owned by the engine's uid on the host (root, under a root engine);
  workspaces are mounted nosuid where they can be (disk.py), this covers where they
  cannot. ``openat2`` (its mode behind a pointer) answers ENOSYS; libc never needs it.

Only the native architecture is allowed; a syscall made through another ABI (i386
``int 0x80``, x32) kills the process, libseccomp's default for a foreign arch.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import tempfile

from .policy import SandboxUnavailable

DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "mount",
    "umount2",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "pivot_root",
    "unshare",
    "setns",
)

TIOCSTI = 0x5412
TIOCLINUX = 0x541C
AF_UNIX = 1
S_ISUID = 0o4000
S_ISGID = 0o2000
O_CREAT = 0o100
O_TMPFILE = 0o20200000  # __O_TMPFILE | O_DIRECTORY, as libc passes it
# (syscall, index of its mode argument, index of its flags argument or None)
MODE_SYSCALLS = (
    ("chmod", 1, None),
    ("fchmod", 1, None),
    ("fchmodat", 2, None),
    ("fchmodat2", 2, None),
    ("mknod", 1, None),
    ("mknodat", 2, None),
    ("creat", 1, None),
    ("open", 2, 1),
    ("openat", 3, 2),
)
CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
)


_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_NE = 1
_SCMP_CMP_MASKED_EQ = 7
_NR_SCMP_ERROR = -1


def _errno_action(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)  # SCMP_ACT_ERRNO(err)


class _ArgCmp(ctypes.Structure):
    """``struct scmp_arg_cmp``: compare syscall argument ``arg`` with ``op``."""

    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),  # MASKED_EQ: the mask
        ("datum_b", ctypes.c_uint64),  # MASKED_EQ: the value
    )


def _libseccomp() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError as exc:
        raise SandboxUnavailable(
            f"seccomp: libseccomp.so.2 is not installed (apt-get install libseccomp2): {exc}"
        ) from exc
    lib.seccomp_init.argtypes = (ctypes.c_uint32,)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_release.argtypes = (ctypes.c_void_p,)
    lib.seccomp_release.restype = None
    lib.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    )
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
    lib.seccomp_export_bpf.restype = ctypes.c_int
    return lib


def _add_rule(
    lib: ctypes.CDLL, ctx: int, action: int, name: str, *cmp: tuple[int, int, int, int]
) -> None:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr == _NR_SCMP_ERROR:
        raise SandboxUnavailable(f"seccomp: libseccomp does not know the syscall {name}")
    if nr < 0:
        return  # a syscall this architecture does not have cannot be called
    args = (_ArgCmp * len(cmp))(*(_ArgCmp(*c) for c in cmp)) if cmp else None
    res = lib.seccomp_rule_add_array(ctx, action, nr, len(cmp), args)
    if res < 0:
        raise SandboxUnavailable(f"seccomp: cannot add the rule for {name}: {os.strerror(-res)}")


@functools.cache
def filter_program(*, network: bool) -> bytes:
    """The BPF program (``struct sock_filter`` array) for ``bwrap --seccomp``.

    Raises SandboxUnavailable if libseccomp is missing or rejects a rule.
    """
    lib = _libseccomp()
    eperm = _errno_action(errno.EPERM)
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SandboxUnavailable("seccomp: seccomp_init failed")
    try:
        for name in DENIED_SYSCALLS:
            _add_rule(lib, ctx, eperm, name)
        _add_rule(lib, ctx, _errno_action(errno.ENOSYS), "clone3")
        for flag in CLONE_NAMESPACE_FLAGS:
            _add_rule(lib, ctx, eperm, "clone", (0, _SCMP_CMP_MASKED_EQ, flag, flag))
        for request in (TIOCSTI, TIOCLINUX):
            _add_rule(lib, ctx, eperm, "ioctl", (1, _SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, request))
        if not network:
            _add_rule(lib, ctx, eperm, "socket", (0, _SCMP_CMP_NE, AF_UNIX, 0))
        _add_rule(lib, ctx, _errno_action(errno.ENOSYS), "openat2")
        for name, mode_arg, flags_arg in MODE_SYSCALLS:
            for bit in (S_ISUID, S_ISGID):
                mode_cmp = (mode_arg, _SCMP_CMP_MASKED_EQ, bit, bit)
                if flags_arg is None:
                    _add_rule(lib, ctx, eperm, name, mode_cmp)
                    continue
                for creating in (O_CREAT, O_TMPFILE):
                    flags_cmp = (flags_arg, _SCMP_CMP_MASKED_EQ, creating, creating)
                    _add_rule(lib, ctx, eperm, name, flags_cmp, mode_cmp)
        with tempfile.TemporaryFile() as out:
            res = lib.seccomp_export_bpf(ctx, out.fileno())
            if res < 0:
                raise SandboxUnavailable(f"seccomp: export failed: {os.strerror(-res)}")
            out.seek(0)
            program = out.read()
    finally:
        lib.seccomp_release(ctx)
    if not program or len(program) % 8:
        raise SandboxUnavailable("seccomp: libseccomp exported an empty or malformed program")
    return program


def program_fd(*, network: bool) -> int:
    """A pipe's read end holding the program; bwrap reads it to EOF. The caller closes it."""
    program = filter_program(network=network)
    read_end, write_end = os.pipe()
    try:
        # A few hundred bytes: far below the pipe buffer, so this cannot block.
        os.write(write_end, program)
    finally:
        os.close(write_end)
    return read_end
