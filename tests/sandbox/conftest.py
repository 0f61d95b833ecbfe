"""Fixtures for the sandbox tests: real bubblewrap, real processes, throwaway workspaces.

There is no skip: if the host cannot sandbox (no bwrap, no user namespaces, ...)
every test errors with the reason. CI installs bubblewrap and libseccomp2.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from holdfast_tool_runner.sandbox import SandboxPolicy, SandboxUnavailable, network
from holdfast_tool_runner.sandbox.runner import Host, default_host


@pytest.fixture(scope="session", autouse=True)
def sandbox_host() -> Host:
    try:
        return default_host()
    except SandboxUnavailable as exc:
        pytest.fail(f"this host cannot run the sandbox: {exc}")


@pytest.fixture(autouse=True)
async def _slirp_settled() -> AsyncIterator[None]:
    # A call returns before its slirp4netns has exited; not before this test ends.
    yield
    await network.settle()


@dataclasses.dataclass(frozen=True)
class Workspaces:
    """Two tasks' workspaces, and an engine data directory beside them."""

    mine: Path
    other: Path
    engine: Path


@pytest.fixture
def workspaces(tmp_path: Path) -> Workspaces:
    # pytest's base temp dir is mode 0700, which run_sandboxed requires of a parent.
    mine, other, engine = tmp_path / "ws-mine", tmp_path / "ws-other", tmp_path / "engine-data"
    for d in (mine, other, engine):
        d.mkdir()
    (other / "secret.txt").write_text("OTHER-TASK-SECRET\n")
    (engine / "config.toml").write_text('api_key = "ENGINE-SECRET"\n')
    return Workspaces(mine, other, engine)


PolicyFactory = Callable[..., SandboxPolicy]


@pytest.fixture
def policy(workspaces: Workspaces) -> PolicyFactory:
    """A small, fast policy on the ``mine`` workspace; keywords override fields."""

    def make(**overrides: Any) -> SandboxPolicy:
        fields: dict[str, Any] = {
            "workspace": workspaces.mine,
            "timeout_seconds": 10.0,
            "memory_bytes": 256 * 2**20,
            "pids_max": 64,
            "file_size_bytes": 16 * 2**20,
            "tmpfs_bytes": 16 * 2**20,
        }
        fields.update(overrides)
        return SandboxPolicy(**fields)

    return make


def host_processes() -> dict[int, str]:
    """pid -> command line of every process on the host."""
    procs = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            procs[int(entry)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return procs


def on_host(path: str | Path) -> bool:
    """Whether ``path`` exists on the host (outside any sandbox)."""
    return os.path.lexists(path)
