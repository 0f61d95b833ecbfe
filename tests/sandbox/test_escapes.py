"""The escape corpus: each attempt runs through run_sandboxed with real processes, and
must be blocked, reported (exit status or error text), and leave the host unaffected.

The comment on each test names the layer that stops it. What the probe of issue #9
added (several processes together over the memory limit, filling the disk across many
files, a setuid copy, read_file on a FIFO) is in test_limits.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import platform
import secrets
import socket
import stat
import textwrap
import time
from pathlib import Path

import pytest
from holdfast_tool_runner.sandbox import SandboxResult, reap_leftovers, run_sandboxed
from holdfast_tool_runner.sandbox.limits import Cgroup
from holdfast_tool_runner.sandbox.runner import Host

from .conftest import PolicyFactory, Workspaces, host_processes, on_host

REPO_ROOT = Path(__file__).resolve().parents[2]
SYS_IOCTL = {"x86_64": 16, "aarch64": 29}[platform.machine()]
SYS_IO_URING_SETUP = 425


async def sh(script: str, policy: PolicyFactory, **overrides: object) -> SandboxResult:
    return await run_sandboxed(["sh", "-c", script], policy(**overrides))


async def py(script: str, policy: PolicyFactory, **overrides: object) -> SandboxResult:
    """Run a Python script with the sandbox's (system) interpreter."""
    return await run_sandboxed(["python3", "-c", textwrap.dedent(script)], policy(**overrides))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def gone(marker: str, within: float = 2.0) -> bool:
    """True once no host process has ``marker`` in its command line."""
    deadline = time.monotonic() + within
    while any(marker in cmd for cmd in host_processes().values()):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# -- reading outside the workspace: bwrap (nothing else is mounted) -----------------


async def test_read_etc_shadow(policy: PolicyFactory) -> None:
    assert on_host("/etc/shadow")
    result = await sh("cat /etc/shadow", policy)
    assert result.exit_code != 0
    assert "No such file or directory" in result.stderr
    assert "root:" not in result.stdout


async def test_read_engine_files_and_config(policy: PolicyFactory, workspaces: Workspaces) -> None:
    engine_config = workspaces.engine / "config.toml"
    targets = [engine_config, REPO_ROOT / "pyproject.toml", REPO_ROOT / ".venv/pyvenv.cfg"]
    result = await sh(" ; ".join(f"cat {t}" for t in targets), policy)
    assert result.exit_code != 0
    assert result.stderr.count("No such file or directory") == len(targets)
    assert "ENGINE-SECRET" not in result.stdout and "holdfast" not in result.stdout


async def test_read_another_tasks_workspace(policy: PolicyFactory, workspaces: Workspaces) -> None:
    secret = workspaces.other / "secret.txt"
    result = await sh(f"cat {secret}; cat ../{workspaces.other.name}/secret.txt", policy)
    assert result.exit_code != 0
    assert result.stderr.count("No such file or directory") == 2
    assert "OTHER-TASK-SECRET" not in result.stdout


# -- writing outside the workspace: read-only mounts, then Landlock -----------------


async def test_write_outside_workspace(policy: PolicyFactory, workspaces: Workspaces) -> None:
    targets = [
        "/usr/pwned",
        "/etc/pwned",
        "/pwned",
        "/proc/pwned",
        "/workspace/../pwned",
        str(workspaces.other / "pwned"),
        str(workspaces.engine / "pwned"),
        str(workspaces.mine.parent / "pwned"),
    ]
    script = "\n".join(f'echo pwned > "{t}" && echo "WROTE {t}"' for t in targets)
    result = await sh(script + "\nexit 1", policy)
    assert result.exit_code == 1
    assert "WROTE" not in result.stdout
    assert len(result.stderr.strip().splitlines()) == len(targets)
    for t in ("/usr/pwned", "/etc/pwned", "/pwned"):
        assert not on_host(t)
    for d in (workspaces.other, workspaces.engine, workspaces.mine.parent):
        assert not on_host(d / "pwned")


async def test_landlock_denies_a_write_bwrap_allows(policy: PolicyFactory) -> None:
    # /proc is writable as far as the mounts go; only Landlock refuses this.
    result = await sh("echo pwned > /proc/self/comm", policy)
    assert result.exit_code != 0
    assert "Permission denied" in result.stderr


async def test_chmod_of_a_host_device_node(policy: PolicyFactory) -> None:
    # The sandbox's kernel uid is 0 under a root engine; private nodes owned by nobody.
    before = os.stat("/dev/null")
    result = await sh("chmod 000 /dev/null", policy)
    assert result.exit_code != 0
    assert "Operation not permitted" in result.stderr
    after = os.stat("/dev/null")
    assert stat.S_IMODE(after.st_mode) == stat.S_IMODE(before.st_mode) == 0o666


async def test_symlinks_pointing_outside(policy: PolicyFactory, workspaces: Workspaces) -> None:
    # Symlinks resolve inside the sandbox's mount tree, where the targets do not exist.
    other_secret = workspaces.other / "secret.txt"
    links = {
        "shadow": "/etc/shadow",
        "other-abs": str(other_secret),
        "other-rel": f"../{workspaces.other.name}/secret.txt",
        "engine": str(workspaces.engine / "config.toml"),
    }
    for name, target in links.items():
        (workspaces.mine / name).symlink_to(target)
    passwd_before, secret_before = digest(Path("/etc/passwd")), digest(other_secret)
    reads = " ; ".join(f"cat {name}" for name in links)
    writes = " ; ".join(f"echo pwned >> {name}" for name in links)
    made = "ln -s /etc/passwd made ; echo pwned >> made ; ln -s / root ; cat root/etc/shadow"
    result = await sh(f"{reads} ; {writes} ; {made}", policy)
    assert result.exit_code != 0
    assert "SECRET" not in result.stdout and "root:" not in result.stdout
    errors = result.stderr.splitlines()
    assert len(errors) == 2 * len(links) + 2  # every read and write failed, and `made`'s
    assert errors[: len(links)] == [f"cat: {n}: No such file or directory" for n in links]
    assert "sh: 1: cannot create made: Read-only file system" in errors
    assert digest(Path("/etc/passwd")) == passwd_before
    assert digest(other_secret) == secret_before


# -- network: seccomp refuses non-unix sockets; new netns; Landlock TCP rules -------


async def test_connect_to_engine_redis_postgres_and_elsewhere(policy: PolicyFactory) -> None:
    accepted: list[bool] = []

    async def on_connect(_r: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(True)
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    # Addresses stay on loopback: this workplace forbids traffic elsewhere, and the
    # refusal happens at socket(), before any address is looked at.
    targets = [("127.0.0.1", 6379), ("127.0.0.1", 5432), ("127.0.0.1", port), ("127.0.0.2", 80)]
    script = f"""
        import errno, socket
        for host, port in {targets!r} + [("::1", 5432)]:
            try:
                socket.create_connection((host, port), timeout=5)
                print(port, "CONNECTED")
            except OSError as exc:
                print(port, errno.errorcode.get(exc.errno, exc))
        try:
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.53", 53))
        except OSError as exc:
            print("udp", errno.errorcode.get(exc.errno, exc))
    """
    try:
        started = time.monotonic()
        result = await py(script, policy)
        elapsed = time.monotonic() - started
    finally:
        server.close()
        await server.wait_closed()
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 6 and all(line.endswith(" EPERM") for line in lines), result
    assert elapsed < 3, "a blocked connection must fail at once, not time out"
    assert accepted == []


async def test_abstract_unix_socket_of_the_host(policy: PolicyFactory, sandbox_host: Host) -> None:
    name = b"\0holdfast-test-" + secrets.token_hex(4).encode()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen()
    listener.setblocking(False)
    script = f"""
        import errno, socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect({name!r})
            print("CONNECTED")
        except OSError as exc:
            print(errno.errorcode[exc.errno])
            raise SystemExit(1)
    """
    try:
        # Network off: abstract names are per network namespace, and ours is new.
        isolated = await py(script, policy)
        # Network on: behind slirp4netns the namespace is still our own; where the
        # host's is shared instead, Landlock ABI 6 scopes abstract sockets.
        online = await py(script, policy, network=True)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert isolated.exit_code == 1 and isolated.stdout.strip() == "ECONNREFUSED"
    if online.mechanisms["network"] == "slirp4netns":
        assert online.exit_code == 1 and online.stdout.strip() == "ECONNREFUSED"
    elif sandbox_host.landlock_abi >= 6:
        assert online.exit_code == 1 and online.stdout.strip() == "EPERM"


# -- syscalls: seccomp --------------------------------------------------------------


async def test_tiocsti_and_tioclinux(policy: PolicyFactory) -> None:
    # stdin is a pipe: without seccomp these would be ENOTTY, so EPERM is the filter.
    script = f"""
        import ctypes, errno, fcntl, termios
        for name, request in (("TIOCSTI", termios.TIOCSTI), ("TIOCLINUX", 0x541C)):
            try:
                fcntl.ioctl(0, request, b"x")
            except OSError as exc:
                print(name, errno.errorcode[exc.errno])
        # The kernel ignores the upper 32 bits of the request; so must the filter.
        libc = ctypes.CDLL(None, use_errno=True)
        c = ctypes.c_char(b"x")
        request = ctypes.c_long(termios.TIOCSTI | 1 << 32)
        res = libc.syscall(ctypes.c_long({SYS_IOCTL}), ctypes.c_long(0), request, ctypes.byref(c))
        print("TIOCSTI|1<<32", errno.errorcode[ctypes.get_errno()] if res else "OK")
    """
    result = await py(script, policy)
    assert result.stdout.split("\n")[:3] == [
        "TIOCSTI EPERM",
        "TIOCLINUX EPERM",
        "TIOCSTI|1<<32 EPERM",
    ], result


async def test_ptrace_and_process_vm_readv_of_a_sibling(policy: PolicyFactory) -> None:
    script = """
        import ctypes, errno, subprocess
        libc = ctypes.CDLL(None, use_errno=True)
        sibling = subprocess.Popen(["sleep", "30"])
        res = libc.ptrace(16, sibling.pid, None, None)  # PTRACE_ATTACH
        print("ptrace", res, errno.errorcode[ctypes.get_errno()])

        class IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        buf = ctypes.create_string_buffer(8)
        local, remote = IoVec(ctypes.addressof(buf), 8), IoVec(ctypes.addressof(buf), 8)
        res = libc.process_vm_readv(sibling.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        print("process_vm_readv", res, errno.errorcode[ctypes.get_errno()])
        sibling.kill()
        raise SystemExit(1)
    """
    result = await py(script, policy)
    assert result.exit_code == 1
    assert result.stdout.splitlines() == ["ptrace -1 EPERM", "process_vm_readv -1 EPERM"]


async def test_io_uring(policy: PolicyFactory) -> None:
    script = f"""
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        params = ctypes.create_string_buffer(120)
        res = libc.syscall(ctypes.c_long({SYS_IO_URING_SETUP}), ctypes.c_long(8), params)
        print("io_uring_setup", res, errno.errorcode[ctypes.get_errno()])
        raise SystemExit(1)
    """
    result = await py(script, policy)
    assert result.exit_code == 1
    assert result.stdout.strip() in ("io_uring_setup -1 EPERM", "io_uring_setup -1 ENOSYS")


async def test_new_namespaces(policy: PolicyFactory) -> None:
    # unshare(2) and clone(CLONE_NEW*) are refused, and bwrap disabled nested userns.
    result = await sh("unshare --user --map-root-user id; unshare --net true", policy)
    assert result.exit_code != 0
    assert result.stderr.count("Operation not permitted") == 2


# -- resources: cgroups / rlimits, the wall-clock timeout, the pid namespace --------


async def test_fork_bomb(policy: PolicyFactory) -> None:
    # Every fork of the bomb keeps this command line, marker included.
    marker = f"bomb-{secrets.token_hex(4)}"
    script = f"bomb() {{ bomb | bomb & }}; bomb; wait # {marker}"
    result = await sh(script, policy, pids_max=32, timeout_seconds=3)
    # It burns out on failed forks (reported by bash, or by the pids limit) or
    # runs into the timeout; either way it is bounded and leaves nothing.
    # (Under load the bomb can also collapse on its own before any limit.)
    reported = result.timed_out or "fork" in result.stderr.lower() or "pids" in result.limit_events
    assert reported or result.exit_code == 0, result
    assert result.duration_ms < 4000
    assert await gone(marker), "fork bomb processes outlived the call"


async def test_memory_bomb(policy: PolicyFactory) -> None:
    script = """
        hoard = []
        while True:
            hoard.append(bytearray(8 << 20))
    """
    result = await py(script, policy, memory_bytes=128 * 2**20)
    assert result.exit_code != 0
    assert result.killed_reason == "memory" or "MemoryError" in result.stderr, result


async def test_disk_filling_write(policy: PolicyFactory, workspaces: Workspaces) -> None:
    limit = 4 * 2**20
    result = await sh("dd if=/dev/zero of=big bs=1M count=10000", policy, file_size_bytes=limit)
    assert result.exit_code == 128 + 25 and result.killed_reason == "file_size"
    assert (workspaces.mine / "big").stat().st_size <= limit
    # /tmp is a tmpfs in host memory: bounded by its size.
    result = await sh("dd if=/dev/zero of=/tmp/big bs=1M count=10000", policy, tmpfs_bytes=limit)
    assert result.exit_code == 1
    assert "No space left on device" in result.stderr


async def test_endless_loop(policy: PolicyFactory) -> None:
    result = await sh("while :; do :; done", policy, timeout_seconds=1)
    assert result.timed_out and result.killed_reason == "timeout"
    assert result.exit_code is None
    assert 1000 <= result.duration_ms < 2500


async def test_background_process_left_running(policy: PolicyFactory) -> None:
    marker = f"987.{secrets.randbelow(10**6):06d}"
    result = await sh(f"setsid nohup sleep {marker} >/dev/null 2>&1 & echo started", policy)
    assert result.exit_code == 0 and result.stdout == "started\n"
    assert await gone(marker), "a background process survived its call"


async def test_reap_leftovers_kills_a_running_call(
    policy: PolicyFactory, workspaces: Workspaces
) -> None:
    marker = f"986.{secrets.randbelow(10**6):06d}"
    call = asyncio.create_task(run_sandboxed(["sleep", marker], policy(timeout_seconds=30)))
    deadline = time.monotonic() + 5
    while not any(marker in cmd for cmd in host_processes().values()):
        assert time.monotonic() < deadline and not call.done()
        await asyncio.sleep(0.02)
    assert await reap_leftovers(workspaces.mine) >= 1
    result = await asyncio.wait_for(call, 5)
    assert result.killed_reason == "reaped" and result.exit_code is None
    assert await gone(marker)


async def test_reap_leftovers_of_a_dead_runner(workspaces: Workspaces, sandbox_host: Host) -> None:
    # A runner that crashed leaves its call's cgroup behind with processes in it; the
    # cgroup is named after the runner's pid, which no process has any more.
    subtree = sandbox_host.cgroups.v2 or sandbox_host.cgroups.v1_pids
    if subtree is None:
        pytest.skip("no cgroup on this host: calls are tracked by session and pid namespace")
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    leaf = Cgroup(subtree / f"{dead.pid}-deadrunner")
    leaf.path.mkdir()
    marker = f"985.{secrets.randbelow(10**6):06d}"
    orphan = await asyncio.create_subprocess_exec("sleep", marker)
    try:
        (leaf.path / "cgroup.procs").write_text(str(orphan.pid))
        assert await reap_leftovers(workspaces.mine) == 1
        assert await asyncio.wait_for(orphan.wait(), 5) == -9
        assert not leaf.path.exists()
    finally:
        if orphan.returncode is None:
            orphan.kill()
            await orphan.wait()
        await leaf.remove()
