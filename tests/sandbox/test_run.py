"""What a sandboxed command can do, what it gets back, and failing closed."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from holdfast_tool_runner.sandbox import (
    SandboxPolicy,
    SandboxUnavailable,
    probe,
    run_sandboxed,
)
from holdfast_tool_runner.sandbox.runner import Host

from .conftest import PolicyFactory, Workspaces, on_host


async def test_stdout_stderr_and_exit_code(policy: PolicyFactory) -> None:
    result = await run_sandboxed(["sh", "-c", "echo hello; echo oops >&2; exit 3"], policy())
    assert (result.exit_code, result.stdout, result.stderr) == (3, "hello\n", "oops\n")
    assert not result.truncated and not result.timed_out and result.killed_reason is None
    assert result.mechanisms["kill"] in ("cgroup2", "cgroup1", "session")


async def test_stdin(policy: PolicyFactory) -> None:
    result = await run_sandboxed(["cat"], policy(), stdin=b"from the engine")
    assert result.ok and result.stdout == "from the engine"
    # A command that never reads a large stdin must not hang the call.
    result = await run_sandboxed(["true"], policy(), stdin=b"x" * 2**20)
    assert result.ok


async def test_workspace_is_the_writable_cwd(policy: PolicyFactory, workspaces: Workspaces) -> None:
    (workspaces.mine / "input.txt").write_text("from the host\n")
    script = (
        "pwd; cat input.txt; echo from the sandbox > output.txt; mkdir -p a/b; mv output.txt a/b/"
    )
    result = await run_sandboxed(["sh", "-c", script], policy())
    assert result.ok, result
    assert result.stdout == "/workspace\nfrom the host\n"
    assert (workspaces.mine / "a/b/output.txt").read_text() == "from the sandbox\n"


async def test_private_tmp(policy: PolicyFactory) -> None:
    name = f"holdfast-sandbox-test-{id(policy)}"
    result = await run_sandboxed(["sh", "-c", f"echo x > /tmp/{name} && cat /tmp/{name}"], policy())
    assert result.ok and result.stdout == "x\n"
    assert not on_host(Path("/tmp", name))


async def test_output_is_capped_and_marked(policy: PolicyFactory) -> None:
    result = await run_sandboxed(
        ["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' a; head -c 30000000 /dev/zero >&2"],
        policy(max_output_bytes=1000),
    )
    assert result.ok and result.truncated
    assert result.stdout == "a" * 1000 + "\n[... output truncated at 1000 bytes]"
    assert result.stderr.endswith("\n[... output truncated at 1000 bytes]")


async def test_environment_is_scrubbed(
    policy: PolicyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOLDFAST_DATABASE_URL", "postgresql://engine:SECRET-PG@db/holdfast")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-SECRET-KEY")
    result = await run_sandboxed(
        ["sh", "-c", "env; echo ---; (tr '\\0' '\\n' < /proc/1/environ) 2>&1; true"], policy()
    )
    assert result.ok, result
    assert "SECRET" not in result.stdout and "HOLDFAST" not in result.stdout
    names = {line.split("=", 1)[0] for line in result.stdout.split("---")[0].splitlines()}
    assert names <= {"PATH", "HOME", "LANG", "TERM", "TMPDIR", "PWD", "OLDPWD", "SHLVL", "_"}
    assert "HOME=/workspace" in result.stdout and "TERM=dumb" in result.stdout


async def test_no_inherited_descriptors(policy: PolicyFactory) -> None:
    script = "import os; print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))"
    result = await run_sandboxed(["python3", "-c", script], policy())
    assert result.stdout.strip() == "[0, 1, 2, 3]"  # 3: the listing itself


def _outbound_address() -> str | None:
    """This host's address on its default route (no packet is sent), if it has one."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.254", 9))
        address: str = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


async def _pong_server(host: str) -> tuple[asyncio.Server, int]:
    async def pong(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.readline() == b"ping\n":
            writer.write(b"pong\n")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(pong, host, 0)
    return server, server.sockets[0].getsockname()[1]


def _ping(host: str, port: int) -> list[str]:
    script = (
        "import socket\n"
        "try:\n"
        f"    s = socket.create_connection(({host!r}, {port}), timeout=3)\n"
        "    s.sendall(b'ping\\n'); print(s.makefile().readline().strip())\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__); raise SystemExit(1)\n"
    )
    return ["python3", "-c", script]


async def test_network_when_the_policy_allows_it(policy: PolicyFactory) -> None:
    address = _outbound_address()
    if address is None:
        pytest.skip("this host has no address besides loopback to reach")
    server, port = await _pong_server(address)
    try:
        allowed = await run_sandboxed(_ping(address, port), policy(network=True))
        denied = await run_sandboxed(_ping(address, port), policy())
    finally:
        server.close()
        await server.wait_closed()
    assert allowed.ok and allowed.stdout == "pong\n", allowed
    assert denied.exit_code == 1 and denied.stdout == "PermissionError\n"


async def test_network_never_reaches_the_hosts_loopback(
    policy: PolicyFactory, sandbox_host: Host
) -> None:
    # The engine's Redis, PostgreSQL and gateway listen there; behind slirp4netns the
    # sandbox's 127.0.0.1 is its own and the host's (10.0.2.2) is refused.
    if sandbox_host.slirp4netns is None:
        pytest.skip("no slirp4netns: a sandbox with network shares the host's (README)")
    server, port = await _pong_server("127.0.0.1")
    try:
        own = await run_sandboxed(_ping("127.0.0.1", port), policy(network=True))
        gateway = await run_sandboxed(_ping("10.0.2.2", port), policy(network=True))
    finally:
        server.close()
        await server.wait_closed()
    assert own.exit_code == 1 and own.stdout == "ConnectionRefusedError\n", own
    assert gateway.exit_code == 1 and gateway.stdout != "pong\n", gateway
    assert own.mechanisms["network"] == "slirp4netns"


async def test_network_sandbox_has_slirps_interface_and_resolver(
    policy: PolicyFactory, sandbox_host: Host
) -> None:
    if sandbox_host.slirp4netns is None:
        pytest.skip("no slirp4netns")
    result = await run_sandboxed(
        ["sh", "-c", "cat /etc/resolv.conf; grep -c tap0: /proc/net/dev"],
        policy(network=True),
    )
    assert result.ok, result
    assert result.stdout == "nameserver 10.0.2.3\n1\n"


async def test_command_not_found_is_the_commands_failure(policy: PolicyFactory) -> None:
    result = await run_sandboxed(["no-such-command"], policy())
    assert result.exit_code == 127
    assert "no-such-command: No such file or directory" in result.stderr


async def test_probe() -> None:
    described = {"disk": "loop-ext4", "max_bytes": 2**30, "problem": None}
    found = await probe(workspaces=described)
    assert found.available, found.problem
    assert found.seccomp and found.user_namespaces and found.bwrap_version
    assert found.landlock_abi >= 1
    assert set(found.limits) == {"pids", "memory", "cpu", "file_size", "kill", "disk"}
    assert found.limits["memory"] in ("cgroup2", "cgroup1", "rss-budget")
    assert found.limits["cpu"] in ("cgroup2", "cgroup1", "time-budget")
    assert found.limits["disk"] == "loop-ext4"  # as the runner's workspaces say
    assert found.as_dict()["workspaces"] == described
    assert found.network == ("slirp4netns" if shutil.which("slirp4netns") else "host")


# -- failing closed ------------------------------------------------------------------


async def test_refuses_bad_workspaces(workspaces: Workspaces) -> None:
    with pytest.raises(SandboxUnavailable, match="No such file"):
        await run_sandboxed(["true"], SandboxPolicy(workspace=workspaces.mine / "missing"))
    with pytest.raises(SandboxUnavailable, match="system directory"):
        await run_sandboxed(["true"], SandboxPolicy(workspace=Path("/usr/share")))
    exposed = Path(await asyncio.to_thread(tempfile.mkdtemp, dir="/tmp"))  # parents: /tmp, /
    try:
        with pytest.raises(SandboxUnavailable, match="closed to other users"):
            await run_sandboxed(["true"], SandboxPolicy(workspace=exposed))
    finally:
        await asyncio.to_thread(shutil.rmtree, exposed)


async def test_fails_closed_without_bwrap(policy: PolicyFactory, sandbox_host: Host) -> None:
    with pytest.raises(SandboxUnavailable, match="bubblewrap is not installed"):
        Host.discover(path="/nonexistent")
    # A host whose bwrap went away after it was discovered: nothing runs either.
    gone = dataclasses.replace(sandbox_host, bwrap="/nonexistent/bwrap")
    with pytest.raises(SandboxUnavailable):
        await run_sandboxed(["true"], policy(), host=gone)


async def test_fails_closed_when_landlock_cannot_be_applied(
    policy: PolicyFactory,
    workspaces: Workspaces,
    sandbox_host: Host,
) -> None:
    # The shim is told to expect a Landlock ABI the kernel does not have.
    broken = dataclasses.replace(sandbox_host, landlock_abi=99)
    with pytest.raises(SandboxUnavailable, match="landlock: kernel Landlock ABI"):
        await run_sandboxed(["touch", "ran"], policy(), host=broken)
    assert not (workspaces.mine / "ran").exists()


async def test_fails_closed_when_bwrap_fails(policy: PolicyFactory, sandbox_host: Host) -> None:
    # Anything that exits without the shim's confirmation is not a result.
    broken = dataclasses.replace(sandbox_host, bwrap="/bin/false")
    with pytest.raises(SandboxUnavailable, match="set-up failed"):
        await run_sandboxed(["true"], policy(), host=broken)
