"""A task's processes held still while its workspace is archived (sandbox.frozen).

A stdio MCP server outlives its calls; during a checkpoint it must not change the
workspace (security issue #23: one swapped a directory for a symlink to a host path
while it was archived).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from holdfast_shared.workspace_checkpoints import DirectoryStore
from holdfast_tool_runner.sandbox import frozen, start_resident
from holdfast_tool_runner.workspace_tree import checkpoint

from tests.sandbox.conftest import PolicyFactory, Workspaces

pytestmark = pytest.mark.timeout(60)


def size_of(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


async def grows(path: Path, beyond: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while size_of(path) <= beyond:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def test_a_resident_is_held_still_for_a_checkpoint_then_goes_on(
    policy: PolicyFactory, workspaces: Workspaces, tmp_path: Path
) -> None:
    grow = workspaces.mine / "grow"
    resident = await start_resident(
        ["sh", "-c", "while :; do echo x >> grow; done"], policy(timeout_seconds=60)
    )
    try:
        assert await grows(grow, 0), "the resident never wrote"
        async with frozen(workspaces.mine) as held:
            assert held == 1
            size = size_of(grow)
            # A whole checkpoint's time (the writer appends thousands of times a
            # second when it runs): the archive holds what is there, unchanged.
            result = await checkpoint(
                DirectoryStore(tmp_path / "store"), "tenant", "task", workspaces.mine
            )
            assert result.manifest.entries["grow"].size == size == size_of(grow)
        assert await grows(grow, size), "the resident did not go on"
        assert resident.returncode is None and not resident.reaped
    finally:
        await resident.stop()


async def test_nothing_to_hold_for_a_workspace_without_processes(workspaces: Workspaces) -> None:
    async with frozen(workspaces.other) as held:
        assert held == 0
