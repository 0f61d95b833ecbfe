"""Launchers: sandboxed calls' processes started ahead of the calls (launchers.py).

A call through the pool must be the same sandbox as one without: same limits, same
fds, same clean-up; the pool must refill, survive a dead spare, and leave nothing
behind when it is closed or its runner dies.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from holdfast_tool_runner.sandbox import (
    Launchers,
    SandboxPolicy,
    launcher_pool,
    reap_leftovers,
    run_sandboxed,
)
from holdfast_tool_runner.sandbox import launchers as launchers_module
from holdfast_tool_runner.sandbox.runner import Host

from .conftest import PolicyFactory, Workspaces

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def pool() -> AsyncIterator[Launchers]:
    async with launcher_pool(spares=2) as launchers:
        await until(lambda: launchers.ready == 2)
        yield launchers


async def until(condition: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def cgroup_dirs(found: Host) -> set[Path]:
    dirs: set[Path] = set()
    for subtree in found.cgroups.subtrees():
        dirs.update(p for p in subtree.iterdir() if p.is_dir())
    return dirs


async def test_a_call_uses_a_spare_and_the_pool_refills(
    pool: Launchers, policy: PolicyFactory
) -> None:
    spare_pids = {launcher.process.pid for launcher in pool._ready}
    result = await run_sandboxed(["sh", "-c", "echo $$; echo done"], policy(), launchers=pool)
    assert result.exit_code == 0 and result.stdout.endswith("done\n")
    assert pool.ready == 1  # one taken, the refill starts only once the call is over
    await until(lambda: pool.ready == 2)
    assert spare_pids - {launcher.process.pid for launcher in pool._ready}, "no spare was used"


async def test_a_pooled_call_gets_the_same_sandbox(pool: Launchers, policy: PolicyFactory) -> None:
    # Limits are set when the call takes the launcher, from this call's policy; the
    # launcher's control pipe and the seccomp program the call does not use are gone.
    script = """
        import os, resource, socket
        print(json.dumps({
            "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
            "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
            "core": resource.getrlimit(resource.RLIMIT_CORE)[0],
            "uid": os.getuid(),
            "env": sorted(os.environ),
        }))
        try:
            socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            print("socket allowed")
        except PermissionError:
            print("socket denied")
    """
    argv = ["python3", "-c", "import json\n" + textwrap.dedent(script)]
    size = 3 * 2**20
    for launchers in (pool, None):
        result = await run_sandboxed(argv, policy(file_size_bytes=size), launchers=launchers)
        assert result.exit_code == 0, result.stderr
        report, verdict = result.stdout.splitlines()
        seen = json.loads(report)
        assert seen["fds"] == [0, 1, 2, 3]  # 3: the listdir itself
        assert seen["fsize"] == size and seen["core"] == 0
        assert seen["uid"] == 1000
        assert "HOLDFAST" not in " ".join(seen["env"])
        assert verdict == "socket denied"


async def test_pooled_calls_in_parallel(pool: Launchers, workspaces: Workspaces) -> None:
    # More calls than spares: the rest spawn their own launchers.
    dirs = [workspaces.mine / f"w{i}" for i in range(6)]
    for d in dirs:
        d.mkdir()
    results = await asyncio.gather(
        *(
            run_sandboxed(
                ["sh", "-c", f"echo {i} > n; cat n"], SandboxPolicy(workspace=d), launchers=pool
            )
            for i, d in enumerate(dirs)
        )
    )
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(6)]
    assert all((d / "n").read_text() == f"{i}\n" for i, d in enumerate(dirs))


async def test_a_dead_spare_is_skipped(pool: Launchers, policy: PolicyFactory) -> None:
    victim = pool._ready[0]
    os.kill(victim.process.pid, signal.SIGKILL)
    await victim.process.wait()
    result = await run_sandboxed(["echo", "ok"], policy(), launchers=pool)
    assert result.stdout == "ok\n"
    assert all(launcher is not victim for launcher in pool._ready)


async def test_bad_argv_takes_nothing(pool: Launchers, policy: PolicyFactory) -> None:
    with pytest.raises(ValueError, match="null byte"):
        await run_sandboxed(["echo", "a\0b"], policy(), launchers=pool)
    assert pool.ready == 2


async def test_closing_the_pool_leaves_nothing(policy: PolicyFactory, sandbox_host: Host) -> None:
    before = cgroup_dirs(sandbox_host)
    async with launcher_pool(spares=3) as launchers:
        await until(lambda: launchers.ready == 3)
        pids = [launcher.process.pid for launcher in launchers._ready]
        assert len(cgroup_dirs(sandbox_host) - before) >= 3
    assert not any(alive(pid) for pid in pids)
    assert cgroup_dirs(sandbox_host) <= before


RUNNER = """
import asyncio, json, sys
from holdfast_tool_runner.sandbox import launcher_pool

async def main():
    pool = launcher_pool(spares=2)
    pool.start()
    while pool.ready < 2:
        await asyncio.sleep(0.01)
    print(json.dumps([launcher.process.pid for launcher in pool._ready]), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_spares_of_a_dead_runner_exit_and_are_reaped(
    workspaces: Workspaces, sandbox_host: Host
) -> None:
    before = cgroup_dirs(sandbox_host)
    runner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RUNNER, stdout=asyncio.subprocess.PIPE, cwd=REPO_ROOT
    )
    assert runner.stdout is not None
    try:
        line = await asyncio.wait_for(runner.stdout.readline(), 20)
        pids = json.loads(line)
        left = cgroup_dirs(sandbox_host) - before
        assert len(left) >= 2
    finally:
        runner.kill()
        await runner.wait()
    # Their control pipes closed with the runner: they exit without running anything.
    await until(lambda: not any(alive(pid) for pid in pids))
    assert await reap_leftovers(workspaces.mine) >= len(left)
    assert not any(path.exists() for path in left)


@pytest.mark.parametrize("name", ["launcher.pl", "landlock_shim.pl"])
async def test_perl_programs_compile_under_strict(name: str, sandbox_host: Host) -> None:
    # They load no module at run time (strict.pm alone costs ~1 ms per call).
    source = Path(launchers_module.__file__).with_name(name)
    proc = await asyncio.create_subprocess_exec(
        sandbox_host.perl, "-Mstrict", "-c", str(source), stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 0 and b"syntax OK" in err, err.decode()
