"""The bubblewrap command line: everything the sandboxed process can see.

A fresh root holding only: /usr and the /bin, /lib* symlinks or directories
read-only; a handful of /etc files (generated passwd/group/hosts/nsswitch.conf, and
host files that hold no secrets: ld.so.cache, alternatives, CA certificates);
a fresh /proc for a new pid namespace; a minimal /dev; private tmpfs /tmp and
/dev/shm of a fixed size; and the task's workspace at /workspace, the only writable
host directory and the working directory. The root itself is remounted read-only.
The skills of the call's agent that have files are bound read-only at
/workspace/.skills/<name> (``SandboxPolicy.skill_mounts``), on a tmpfs that is
read-only too: scripts there run, nothing under .skills can be written.

Every namespace is new (``--unshare-all``). When the policy allows the network, the
sandbox keeps its own network namespace, connected by slirp4netns (network.py),
or shares the host's where slirp4netns is not installed. The environment is cleared and replaced by
``ENV``. No host directory other than the workspace is mounted, so the engine's
config, data, virtualenv, sockets (Redis, PostgreSQL) and other tasks' workspaces
do not exist inside.

Why private device nodes when we run as root: bwrap maps the sandbox's uid onto its
caller's, so under a root engine the sandboxed process has kernel uid 0. It has no
capabilities, but it owns every root-owned inode, and ``bwrap --dev`` binds the
host's own /dev/null: ``chmod 000 /dev/null`` inside would change the host's. So the
devices are our own nodes, owned by nobody, bound over bwrap's; chmod gets EPERM.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

from .policy import SandboxPolicy, SandboxUnavailable

WORKSPACE = "/workspace"
# Where skills' folders appear (holdfast_shared.skills.disclosure.MOUNT_DIR).
SKILLS_DIR = f"{WORKSPACE}/.skills"
# The tmpfs under them holds only their mount points.
_SKILLS_TMPFS_BYTES = 64 * 1024
SANDBOX_UID = 1000
SANDBOX_GID = 1000
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORKSPACE,
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "TMPDIR": "/tmp",
}

# In-sandbox paths, for the Landlock rules.
READ_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/proc")
WRITE_PATHS = (WORKSPACE, "/tmp", "/dev/shm")
DEVICE_PATHS = ("/dev",)

_ROOT_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC_FROM_HOST = (
    "alternatives",
    "ld.so.cache",
    "localtime",
    "protocols",
    "services",
    "ssl/certs",  # never all of /etc/ssl: /etc/ssl/private holds keys
    "ssl/openssl.cnf",
)
_ETC_FOR_NETWORK = ("gai.conf", "host.conf")

DEVICES = {
    "null": (1, 3),
    "zero": (1, 5),
    "full": (1, 7),
    "random": (1, 8),
    "urandom": (1, 9),
    "tty": (5, 0),
}
DEVICE_DIR = Path("/dev/.holdfast-sandbox")
_NOBODY = 65534


def generated_etc() -> dict[str, bytes]:
    """The /etc files written for every sandbox, by in-sandbox path."""
    return {
        "/etc/passwd": (
            f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{WORKSPACE}:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        ).encode(),
        "/etc/group": f"sandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n".encode(),
        "/etc/hostname": b"sandbox\n",
        "/etc/hosts": b"127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n::1\tlocalhost ip6-localhost\n",
        "/etc/nsswitch.conf": b"passwd: files\ngroup: files\nhosts: files dns\n",
    }


@functools.cache
def private_devices() -> Path:
    """Create (once) the device nodes bound into sandboxes when we run as root."""
    try:
        DEVICE_DIR.mkdir(mode=0o755, exist_ok=True)
        for name, (major, minor) in DEVICES.items():
            path = DEVICE_DIR / name
            rdev = os.makedev(major, minor)
            try:
                st = path.lstat()
                if (
                    stat.S_ISCHR(st.st_mode)
                    and st.st_rdev == rdev
                    and st.st_uid == _NOBODY
                    and stat.S_IMODE(st.st_mode) == 0o666
                ):
                    continue
            except FileNotFoundError:
                pass
            tmp = DEVICE_DIR / f".{name}.{os.getpid()}"
            os.mknod(tmp, stat.S_IFCHR | 0o666, rdev)
            os.chown(tmp, _NOBODY, _NOBODY)
            os.chmod(tmp, 0o666)  # mknod's mode went through the umask
            os.replace(tmp, path)
    except OSError as exc:
        raise SandboxUnavailable(
            f"bwrap: cannot create private device nodes in {DEVICE_DIR}: {exc}"
        ) from exc
    return DEVICE_DIR


def _root_dirs() -> list[str]:
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for name in _ROOT_DIRS:
        host = Path("/", name)
        if host.is_symlink():  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", str(host), f"/{name}"]
    return args


def bwrap_argv(
    bwrap: str,
    policy: SandboxPolicy,
    workspace: Path,
    *,
    seccomp_fd: int,
    etc_fds: Mapping[str, int],
    devices: Path | None,
    command: Sequence[str],
    uplink_fds: tuple[int, int] | None = None,
) -> list[str]:
    """The full argv: bwrap, its options, ``--``, then ``command`` (run inside).

    ``etc_fds`` maps in-sandbox paths to pipes holding their content (``--file``);
    ``devices`` is the directory of private device nodes, or None to keep bwrap's.
    With the policy's network: ``uplink_fds`` (info, block) keep the sandbox's own
    network namespace for slirp4netns to connect (network.py); without them it shares
    the host's.
    """
    args = [bwrap, "--unshare-all"]
    if policy.network:
        if uplink_fds is None:
            args.append("--share-net")
        else:
            info_fd, block_fd = uplink_fds
            args += ["--info-fd", str(info_fd), "--block-fd", str(block_fd)]
    args += [
        "--unshare-user",
        "--disable-userns",  # and seccomp refuses unshare/clone(CLONE_NEW*) as well
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_GID),
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",  # setsid: no controlling terminal to push input into
        "--cap-drop",
        "ALL",
        "--clearenv",
    ]
    for name, value in (*policy.env, *ENV.items()):
        args += ["--setenv", name, value]
    args += _root_dirs()
    etc = list(_ETC_FROM_HOST)
    if policy.network:
        etc += _ETC_FOR_NETWORK
        if uplink_fds is None:  # the host's network, the host's resolvers
            etc.append("resolv.conf")
    for name in etc:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for path, fd in etc_fds.items():
        # Copied into the root tmpfs, read-only once the root is remounted below.
        args += ["--perms", "0644", "--file", str(fd), path]
    args += ["--proc", "/proc", "--dev", "/dev"]
    if devices is not None:
        for name in DEVICES:
            args += ["--dev-bind", str(devices / name), f"/dev/{name}"]
    size = str(policy.tmpfs_bytes)
    args += ["--size", size, "--tmpfs", "/dev/shm", "--size", size, "--tmpfs", "/tmp"]
    for bound in policy.read_only_paths:
        # After the tmpfs mounts, so a path under /tmp is the host's, read-only.
        args += ["--ro-bind", str(bound), str(bound)]
    args += ["--bind", str(workspace), WORKSPACE]
    if policy.skill_mounts:
        # A small tmpfs over the workspace's .skills (so the mount points are
        # not made in the workspace itself), each skill bound read-only on it,
        # then the tmpfs made read-only too: nothing under .skills is writable.
        args += ["--size", str(_SKILLS_TMPFS_BYTES), "--tmpfs", SKILLS_DIR]
        for folder, name in policy.skill_mounts:
            args += ["--ro-bind", str(folder), f"{SKILLS_DIR}/{name}"]
        args += ["--remount-ro", SKILLS_DIR]
    args += ["--remount-ro", "/", "--chdir", WORKSPACE]
    args += ["--seccomp", str(seccomp_fd), "--", *command]
    return args
