"""Every limit holds per call, not per process; workspaces are capped and removed whole.

Real processes, real cgroups, real mounts. The fallbacks (a per-call budget the
runner's watch enforces, a workspace without a mount) are run on this host too, by
handing the sandbox fewer cgroups or the workspaces a weaker filesystem.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import stat
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import MappingProxyType

import pytest
from holdfast_tool_runner.builtin import run_tool
from holdfast_tool_runner.sandbox import Launchers, SandboxPolicy, SandboxResult, run_sandboxed
from holdfast_tool_runner.sandbox import disk as disk_module
from holdfast_tool_runner.sandbox import runner as runner_module
from holdfast_tool_runner.sandbox.limits import Hierarchies, _descendants
from holdfast_tool_runner.sandbox.runner import Host
from holdfast_tool_runner.workspaces import WorkspaceError
from holdfast_tool_runner.workspaces import Workspaces as TaskWorkspaces

from .conftest import PolicyFactory

MiB = 2**20
# Four processes, each well under the call's limit, together over it.
FOUR_HOGS = """
import os, sys, time
size, hold = int(sys.argv[1]), float(sys.argv[2])
ready_read, ready_write = os.pipe()
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        hoard = bytearray(size)
        for i in range(0, size, 4096):
            hoard[i] = 1
        os.write(ready_write, b"1")
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
os.close(ready_write)
held = b""
while len(held) < 4:  # until all four hold their memory at once
    chunk = os.read(ready_read, 4)
    if not chunk:
        break
    held += chunk
time.sleep(hold)
print(f"{len(held)} held at once")
for pid in kids:
    os.kill(pid, 9)
"""


async def four_hogs(
    policy: SandboxPolicy, each: int, pool: Launchers | None, *, hold: float = 0.0
) -> SandboxResult:
    """Four processes of ``each`` bytes, held together for ``hold`` seconds."""
    argv = ["python3", "-c", FOUR_HOGS, str(each), str(hold)]
    return await run_sandboxed(argv, policy, launchers=pool)


@pytest.fixture
async def budget_pool(sandbox_host: Host) -> AsyncIterator[Launchers]:
    """Launchers whose calls get no memory or cpu cgroup: the per-call budgets apply."""
    found = sandbox_host.cgroups
    kept = {k: v for k, v in found.v1.items() if k == "pids"}
    weaker = Hierarchies(
        v2=found.v2,
        v2_controllers=found.v2_controllers - {"memory", "cpu"},
        v1=MappingProxyType(kept),
    )
    pool = Launchers(sandbox_host.perl, weaker, spares=0)
    yield pool
    await pool.aclose()


# -- memory: bounded for the call as a whole -----------------------------------------


async def test_memory_is_bounded_per_call(policy: PolicyFactory) -> None:
    # 4 x 40 MiB against 64 MiB: each process alone is within the limit.
    result = await four_hogs(policy(memory_bytes=64 * MiB), 40 * MiB, None)
    assert result.killed_reason == "memory" and result.exit_code is None, result
    assert "memory" in result.limit_events
    assert result.mechanisms["memory"] in ("cgroup2", "cgroup1")
    assert result.duration_ms < 1000  # killed, not left to finish its sleep
    # The same call within the limit runs to its end.
    fits = await four_hogs(policy(memory_bytes=256 * MiB), 16 * MiB, None)
    assert fits.ok and fits.stdout == "4 held at once\n", fits


async def test_a_call_whose_process_the_kernel_killed_counts_as_killed_when_the_rest_ends_first(
    policy: PolicyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With v1's memory cgroup the runner's watch, not the kernel, kills the rest of the
    call. Here the rest ends on its own before the watch looks (CI met it as a race: the
    OOM-killed hogs closed the pipe, their parent printed and exited within 0.1 s)."""
    monkeypatch.setattr(runner_module, "WATCH_SECONDS", 60.0)
    one_hog = (
        "import os\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    hoard = bytearray(96 * 2**20)\n"
        "    for i in range(0, len(hoard), 4096):\n"
        "        hoard[i] = 1\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print('parent done')\n"
    )
    result = await run_sandboxed(["python3", "-c", one_hog], policy(memory_bytes=64 * MiB))
    if result.mechanisms["memory"] != "cgroup1":
        pytest.skip("v2's memory.oom.group takes the whole call in the kernel")
    assert result.killed_reason == "memory" and result.exit_code is None, result
    assert "memory" in result.limit_events


async def test_memory_budget_where_no_cgroup_bounds_it(
    policy: PolicyFactory, budget_pool: Launchers
) -> None:
    # Polled: the four must hold their memory longer than the watch's period.
    result = await four_hogs(policy(memory_bytes=64 * MiB), 40 * MiB, budget_pool, hold=2)
    assert result.mechanisms["memory"] == "rss-budget"
    assert result.killed_reason == "memory" and result.exit_code is None, result
    assert result.duration_ms < 1500
    fits = await four_hogs(policy(memory_bytes=256 * MiB), 16 * MiB, budget_pool, hold=0.3)
    assert fits.ok, fits


async def test_cpu_time_budget_where_no_cgroup_bounds_it(
    policy: PolicyFactory, budget_pool: Launchers
) -> None:
    # A budget of ceil(20 s x 0.05) + 1 = 2 CPU seconds for the call: four spinning
    # processes use it up long before the 20 s timeout (each alone would not).
    spin = "for i in 1 2 3 4; do (while :; do :; done) & done; wait"
    result = await run_sandboxed(
        ["sh", "-c", spin], policy(timeout_seconds=20, cpu_quota=0.05), launchers=budget_pool
    )
    assert result.mechanisms["cpu"] == "time-budget"
    assert result.killed_reason == "cpu_time" and not result.timed_out, result
    assert result.exit_code is None


async def test_cpu_rate_is_bounded_per_call(policy: PolicyFactory) -> None:
    # Four spinners for 1 s of wall time under a quarter of a core: the call's
    # processes together get about 0.25 s of CPU (a per-process limit would give 2 s).
    script = "for i in 1 2 3 4; do timeout 1 sh -c 'while :; do :; done' & done; wait; times"
    result = await run_sandboxed(["bash", "-c", script], policy(cpu_quota=0.25))
    if result.mechanisms["cpu"] not in ("cgroup2", "cgroup1"):
        pytest.skip(f"no cpu cgroup here: {result.mechanisms['cpu']}")
    assert result.exit_code == 0, result
    children = result.stdout.splitlines()[-1]  # "0m0.250s 0m0.001s": children's user, sys
    used = sum(float(m) * 60 + float(s) for m, s in re.findall(r"(\d+)m([\d.]+)s", children))
    assert used < 0.7, result.stdout


def test_descendants_walks_the_process_tree() -> None:
    # What the budget watch counts where no cgroup lists a call's processes.
    proc = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(_descendants(proc.pid)) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert _descendants(proc.pid)[0] == proc.pid
    finally:
        for pid in _descendants(proc.pid)[1:]:
            os.kill(pid, 9)
        proc.kill()
        proc.wait()


# -- the workspace: capped, nosuid, nodev --------------------------------------------


@pytest.fixture
def task_workspaces(tmp_path: Path) -> Iterator[TaskWorkspaces]:
    """Workspaces of 8 MiB under a fresh root, every mount undone afterwards."""
    made = TaskWorkspaces(tmp_path / "root", max_bytes=8 * MiB)
    yield made
    for tenant, task in made.list():
        made.remove(tenant, task)


def tmpfs_workspaces(tmp_path: Path) -> TaskWorkspaces:
    try:
        return TaskWorkspaces(tmp_path / "tmpfs-root", max_bytes=8 * MiB, filesystem="tmpfs")
    except WorkspaceError as exc:
        pytest.skip(f"cannot mount here: {exc}")


def test_workspaces_use_the_best_filesystem_here(task_workspaces: TaskWorkspaces) -> None:
    # As root with loop devices and e2fsprogs (CI), the image per workspace.
    expected = "loop-ext4" if os.geteuid() == 0 else "none"
    assert task_workspaces.disk == expected, task_workspaces.disk_problem
    assert task_workspaces.describe()["disk"] == expected


@pytest.mark.parametrize("kind", ["loop-ext4", "tmpfs"])
async def test_disk_fill_across_many_files(
    kind: str, tmp_path: Path, task_workspaces: TaskWorkspaces, policy: PolicyFactory
) -> None:
    spaces = task_workspaces if kind == "loop-ext4" else tmpfs_workspaces(tmp_path)
    if spaces.disk != kind:
        pytest.skip(f"{kind} not available here: {spaces.disk_problem}")
    try:
        workspace = await asyncio.to_thread(spaces.ensure, "tenant-a", "task-fill")
        # 64 files of 1 MiB, each far below RLIMIT_FSIZE: only the cap can stop them.
        fill = "for i in $(seq 64); do head -c 1048576 /dev/zero > f$i || exit 1; done"
        result = await run_sandboxed(["sh", "-c", fill], policy(workspace=workspace))
        assert result.exit_code == 1 and "No space left on device" in result.stderr, result
        used = sum(p.stat().st_size for p in workspace.iterdir())
        assert used <= 8 * MiB
    finally:
        await asyncio.to_thread(spaces.remove, "tenant-a", "task-fill")


@pytest.mark.parametrize("filesystem", ["auto", "none"])
async def test_setuid_copy_is_not_setuid_on_the_host(
    filesystem: str, tmp_path: Path, policy: PolicyFactory
) -> None:
    task_workspaces = TaskWorkspaces(tmp_path / "root", max_bytes=8 * MiB, filesystem=filesystem)
    workspace = await asyncio.to_thread(task_workspaces.ensure, "tenant-a", "task-suid")
    try:
        await _setuid_copy(task_workspaces, workspace, policy)
    finally:
        await asyncio.to_thread(task_workspaces.remove, "tenant-a", "task-suid")


async def _setuid_copy(
    task_workspaces: TaskWorkspaces, workspace: Path, policy: PolicyFactory
) -> None:
    script = (
        "cp /bin/bash ./rootshell; chmod 4755 ./rootshell; echo chmod=$?;"
        "python3 -c \"import os; os.open('made', os.O_CREAT | os.O_WRONLY, 0o6755)\";"
        "echo open=$?; grep ' /workspace ' /proc/self/mountinfo"
    )
    result = await run_sandboxed(["sh", "-c", script], policy(workspace=workspace))
    # seccomp refuses the bit (whatever the mount), the mount ignores it anyway.
    assert "chmod=1" in result.stdout and "open=1" in result.stdout, result
    assert "Operation not permitted" in result.stderr
    inside = result.stdout.splitlines()[-1].split()[5].split(",")
    assert "nosuid" in inside and "nodev" in inside
    copy = workspace / "rootshell"
    assert not copy.stat().st_mode & (stat.S_ISUID | stat.S_ISGID)
    assert not (workspace / "made").exists()
    if task_workspaces.disk != "none":
        flags = os.statvfs(workspace).f_flag
        assert flags & os.ST_NOSUID and flags & os.ST_NODEV
        # Even a bit set from the host side means nothing on this mount.
        os.chmod(copy, 0o4755)
        assert {"nosuid", "nodev"} <= disk_module.mount_options(workspace)


# -- file tools on what is not a regular file -------------------------------------


@pytest.mark.parametrize(
    ("tool", "extra"),
    [
        ("read_file", {}),
        ("write_file", {"content": "x"}),
        ("edit_file", {"old_string": "a", "new_string": "b"}),
    ],
)
@pytest.mark.parametrize(("name", "kind"), [("pipe", "FIFO"), ("link", "FIFO"), ("sock", "socket")])
async def test_file_tools_refuse_a_fifo_or_socket_at_once(
    tool: str, extra: dict[str, str], name: str, kind: str, task_workspaces: TaskWorkspaces
) -> None:
    workspace = await asyncio.to_thread(task_workspaces.ensure, "tenant-a", "task-fifo")
    fifo = workspace / "pipe"
    os.mkfifo(fifo)
    (workspace / "link").symlink_to("pipe")
    listener = socket.socket(socket.AF_UNIX)
    # Through the directory's fd: the full path may be longer than sun_path takes.
    dir_fd = os.open(workspace, os.O_PATH | os.O_DIRECTORY)
    try:
        listener.bind(f"/proc/self/fd/{dir_fd}/sock")
    finally:
        os.close(dir_fd)
    try:
        started = time.monotonic()
        outcome = await run_tool(
            tool, {"path": name, **extra}, workspace, network=False, timeout_seconds=60
        )
    finally:
        listener.close()
    assert time.monotonic() - started < 5
    assert outcome.error is not None and kind in outcome.error, outcome
    assert stat.S_ISFIFO(fifo.lstat().st_mode)  # left as it was


async def test_read_file_still_reads_regular_files(task_workspaces: TaskWorkspaces) -> None:
    workspace = await asyncio.to_thread(task_workspaces.ensure, "tenant-a", "task-read")
    (workspace / "notes.txt").write_text("hello\n")
    outcome = await run_tool(
        "read_file", {"path": "notes.txt"}, workspace, network=False, timeout_seconds=10
    )
    assert outcome.error is None and outcome.output == {"path": "notes.txt", "content": "hello\n"}
    outcome = await run_tool(
        "write_file",
        {"path": "sub/new.txt", "content": "made"},
        workspace,
        network=False,
        timeout_seconds=10,
    )
    assert outcome.error is None and (workspace / "sub" / "new.txt").read_text() == "made"


# -- the Workspaces API ---------------------------------------------------------------


def test_workspaces_are_keyed_by_tenant_and_task(task_workspaces: TaskWorkspaces) -> None:
    a = task_workspaces.ensure("tenant-a", "task-1")
    b = task_workspaces.ensure("tenant-b", "task-1")
    assert a != b and a.parent.name == "tenant-a" and b.name == "task-1"
    (a / "mine.txt").write_text("A")
    assert not (b / "mine.txt").exists()
    assert task_workspaces.list() == [("tenant-a", "task-1"), ("tenant-b", "task-1")]
    assert task_workspaces.orphans(lambda tenant, task: tenant == "tenant-a") == [
        ("tenant-b", "task-1")
    ]
    for bad in ("..", ".", "a/b", "", ".hidden", "x" * 200):
        with pytest.raises(ValueError):
            task_workspaces.path("tenant-a", bad)
        with pytest.raises(ValueError):
            task_workspaces.path(bad, "task-1")


def test_ensure_is_idempotent_under_a_race(task_workspaces: TaskWorkspaces) -> None:
    paths: list[Path] = []
    errors: list[BaseException] = []

    def ensure() -> None:
        try:
            paths.append(task_workspaces.ensure("tenant-a", "task-race"))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=ensure) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and len(set(paths)) == 1
    if task_workspaces.disk != "none":
        target = str(paths[0])
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        assert sum(line.split()[4] == target for line in mounts) == 1


def test_remove_is_complete(task_workspaces: TaskWorkspaces) -> None:
    workspace = task_workspaces.ensure("tenant-a", "task-gone")
    for i in range(20):
        sub = workspace / f"d{i}"
        sub.mkdir()
        for j in range(50):
            (sub / f"f{j}").write_text("x")
    locked = workspace / "locked"
    locked.mkdir()
    (locked / "f").write_text("x")
    locked.chmod(0)
    assert task_workspaces.remove("tenant-a", "task-gone")
    assert not workspace.exists() and not workspace.parent.exists()
    assert not any(str(task_workspaces.root) in line for line in _mount_points())
    assert task_workspaces.list() == []
    assert not task_workspaces.remove("tenant-a", "task-gone")
    # and it can be made again, empty
    again = task_workspaces.ensure("tenant-a", "task-gone")
    assert os.listdir(again) == []


def test_unmount_all_keeps_images(task_workspaces: TaskWorkspaces) -> None:
    workspace = task_workspaces.ensure("tenant-a", "task-kept")
    (workspace / "kept.txt").write_text("kept")
    mounted = task_workspaces.disk != "none"
    assert task_workspaces.unmount_all() == int(mounted)
    assert not disk_module.is_mounted(workspace)
    if task_workspaces.disk == "loop-ext4":
        assert (task_workspaces.ensure("tenant-a", "task-kept") / "kept.txt").read_text() == "kept"


def test_remove_outruns_a_process_still_writing(tmp_path: Path) -> None:
    # Without a mount to drop, rmtree meets files created while it runs.
    spaces = TaskWorkspaces(tmp_path / "plain", max_bytes=8 * MiB, filesystem="none")
    workspace = spaces.ensure("tenant-a", "task-busy")
    writer = subprocess.Popen(
        ["sh", "-c", "i=0; while mkdir -p d/$i && : > d/$i/f; do i=$((i+1)); done"],
        cwd=workspace,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.2)
        assert spaces.remove("tenant-a", "task-busy")
        assert not workspace.exists()
    finally:
        writer.kill()
        writer.wait()
    # The writer could recreate at most its own path (mkdir -p) after removal; not
    # with the workspace root gone, since cwd is unlinked: nothing is left.
    assert not workspace.exists()


def test_bad_workspace_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        TaskWorkspaces(tmp_path / "r", filesystem="zfs")
    with pytest.raises(ValueError):
        TaskWorkspaces(tmp_path / "r", max_bytes=1024)


def test_files_written_before_the_cap_move_into_it(tmp_path: Path) -> None:
    root = tmp_path / "upgrade"
    plain = TaskWorkspaces(root, max_bytes=8 * MiB, filesystem="none")
    (plain.ensure("tenant-a", "task-old") / "kept.txt").write_text("still here")
    capped = TaskWorkspaces(root, max_bytes=8 * MiB)
    if capped.disk == "none":
        pytest.skip(f"cannot mount here: {capped.disk_problem}")
    try:
        workspace = capped.ensure("tenant-a", "task-old")
        assert disk_module.is_mounted(workspace)
        assert (workspace / "kept.txt").read_text() == "still here"
    finally:
        capped.remove("tenant-a", "task-old")


def _mount_points() -> list[str]:
    return [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]


def test_a_root_with_a_space_in_its_path(tmp_path: Path) -> None:
    # mountinfo escapes the space; the nosuid check must still find the mount.
    spaces = TaskWorkspaces(tmp_path / "a root", max_bytes=8 * MiB)
    workspace = spaces.ensure("tenant-a", "task-1")
    try:
        if spaces.disk != "none":
            assert {"nosuid", "nodev"} <= disk_module.mount_options(workspace)
    finally:
        assert spaces.remove("tenant-a", "task-1")
