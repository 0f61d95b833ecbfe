"""A sandbox whose set-up fails in a way that may pass the next time (nothing ran)
is set up again, up to SETUP_ATTEMPTS; any other set-up failure is final."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from holdfast_tool_runner.sandbox import runner
from holdfast_tool_runner.sandbox.policy import SandboxPolicy, SandboxResult, SandboxUnavailable


def _failing(times: int, *, transient: bool) -> tuple[list[int], Any]:
    calls: list[int] = []

    async def run(*_: Any) -> SandboxResult:
        calls.append(1)
        if len(calls) <= times:
            raise SandboxUnavailable("bwrap: loopback: Failed RTM_NEWADDR", transient=transient)
        return SandboxResult(
            exit_code=0,
            stdout="ok",
            stderr="",
            truncated=False,
            timed_out=False,
            killed_reason=None,
            duration_ms=1.0,
        )

    return calls, run


async def test_a_transient_set_up_failure_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls, run = _failing(runner.SETUP_ATTEMPTS - 1, transient=True)
    monkeypatch.setattr(runner, "_run", run)
    result = await runner.run_sandboxed(["true"], SandboxPolicy(workspace=tmp_path, network=True))
    assert result.stdout == "ok" and len(calls) == runner.SETUP_ATTEMPTS


async def test_the_last_attempt_and_other_failures_are_final(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls, run = _failing(runner.SETUP_ATTEMPTS, transient=True)
    monkeypatch.setattr(runner, "_run", run)
    with pytest.raises(SandboxUnavailable):
        await runner.run_sandboxed(["true"], SandboxPolicy(workspace=tmp_path, network=True))
    assert len(calls) == runner.SETUP_ATTEMPTS

    calls, run = _failing(1, transient=False)
    monkeypatch.setattr(runner, "_run", run)
    with pytest.raises(SandboxUnavailable):
        await runner.run_sandboxed(["true"], SandboxPolicy(workspace=tmp_path))
    assert len(calls) == 1
