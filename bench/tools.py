"""Tool execution: the sandbox's own cost, and a tool call's round trip through the engine.

* Sandbox overhead: ``holdfast_tool_runner.sandbox.run_sandboxed(["true"], policy)``
  with a launcher pool of the tool-runner's default size (``HOLDFAST_SANDBOX_SPARES``),
  as the tool-runner calls it, against a bare ``asyncio.create_subprocess_exec("true")``
  (stdout and stderr piped and read in both), alternating, in this process on the
  stdlib asyncio loop like the tool-runner. Also timed: calls without a pool, which
  spawn their own launcher and wait for its move into the call's cgroups. The
  workspace sits under a 0700, root-owned parent, as the sandbox requires when run
  as root.
* Sandboxed execs/s: ``concurrency`` coroutines (the tool-runner's default
  ``HOLDFAST_TOOL_CONCURRENCY`` is 8) call ``run_sandboxed(["true"])`` back
  to back for a fixed time, one workspace each, sharing one launcher pool.
* Round trip: a real tool-runner, loop-worker and gateway; each turn's
  scripted model answer is one ``bash`` call (``true``); the client times the
  ``tool_call`` frame → the ``tool_result`` frame. Both processes are
  instrumented (``bench.instrument``), so the bench can say where that time
  went, step by step, on one clock.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.instrument import Spans
from bench.scenarios import new_client, percentile, script
from bench.sse import Frames, StreamError, stream_frames

TOOL_SCRIPT = script(text="", tool_calls=[{"name": "bash", "input": {"command": "true"}}])


def _policy(workspace: Path) -> Any:
    from holdfast_tool_runner.sandbox import SandboxPolicy

    return SandboxPolicy(workspace=workspace)


async def _bare(argv: list[str]) -> float:
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} exited {proc.returncode}")
    return (time.perf_counter() - start) * 1000


async def _sandboxed(argv: list[str], policy: Any, launchers: Any) -> float:
    from holdfast_tool_runner.sandbox import run_sandboxed

    start = time.perf_counter()
    result = await run_sandboxed(argv, policy, launchers=launchers)
    elapsed = (time.perf_counter() - start) * 1000
    if result.exit_code != 0:
        raise RuntimeError(f"sandboxed {argv} exited {result.exit_code}: {result.stderr[-300:]}")
    return elapsed


def launcher_pool() -> Any:
    """The launcher pool a tool-runner keeps, at its default size."""
    from holdfast_shared.settings import Settings
    from holdfast_tool_runner.sandbox import launcher_pool

    return launcher_pool(spares=Settings.model_fields["sandbox_spares"].default)


@dataclass
class SandboxOverhead:
    bare_ms: list[float]
    sandboxed_ms: list[float]  # through the launcher pool, as the tool-runner runs
    sandboxed_bash_ms: list[float]  # the bash tool's own command: bash -c true
    unpooled_ms: list[float] = field(default_factory=list)  # spawning its own launcher
    gap_ms: float = 0.0
    spares: int = 0
    mechanisms: dict[str, str] = field(default_factory=dict)

    @property
    def overhead_p50(self) -> float:
        return percentile(self.sandboxed_ms, 50) - percentile(self.bare_ms, 50)

    @property
    def ratio(self) -> float:
        return percentile(self.sandboxed_ms, 50) / percentile(self.bare_ms, 50)


def make_workspaces(root: Path, count: int) -> list[Path]:
    """``count`` workspaces under ``root``; ``root``'s parent must be 0700 and root-owned
    (the bench's log directory, from ``mkdtemp``)."""
    root.mkdir(mode=0o700, exist_ok=True)
    out = [root / f"ws{i}" for i in range(count)]
    for path in out:
        path.mkdir(mode=0o700, exist_ok=True)
    return out


async def sandbox_overhead(
    workspace: Path, runs: int, gap_ms: float = 30.0, warmup: int = 10
) -> SandboxOverhead:
    """``runs`` pairs, alternating which goes first; every fourth pair also one
    sandboxed ``bash -c true`` (what the bash tool runs for ``true``) and one
    ``true`` without a launcher pool.

    Each sandboxed call comes after ``gap_ms`` of idle, as tool calls on a
    runner do (they are seconds apart): moving a process into a cgroup takes
    the kernel's cgroup_threadgroup_rwsem for writing, which waits for an RCU
    grace period unless another move happened within the last few ms, so
    back-to-back calls would measure the unpooled path cheaper than the tools
    get it.
    """
    policy = _policy(workspace)
    gap = gap_ms / 1000
    async with launcher_pool() as launchers:
        await asyncio.sleep(0.5)  # let the pool fill, as it has long before a runner's first call
        first = await _sandboxed(["true"], policy, launchers)
        del first
        out = SandboxOverhead([], [], [], gap_ms=gap_ms, spares=launchers.spares)
        bash = ["/bin/bash", "-c", "true"]

        async def sandboxed(argv: list[str], pool: Any = launchers) -> float:
            await asyncio.sleep(gap)
            return await _sandboxed(argv, policy, pool)

        for _ in range(warmup):
            await _bare(["true"])
            await sandboxed(["true"])
            await sandboxed(bash)
        for i in range(runs):
            if i % 2:
                out.sandboxed_ms.append(await sandboxed(["true"]))
                out.bare_ms.append(await _bare(["true"]))
            else:
                out.bare_ms.append(await _bare(["true"]))
                out.sandboxed_ms.append(await sandboxed(["true"]))
            if i % 4 == 0:
                out.sandboxed_bash_ms.append(await sandboxed(bash))
                out.unpooled_ms.append(await sandboxed(["true"], None))
    from holdfast_tool_runner.sandbox import run_sandboxed

    out.mechanisms = dict((await run_sandboxed(["true"], policy)).mechanisms)
    return out


@dataclass
class ExecRate:
    concurrency: int
    execs: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.execs / self.seconds


async def exec_rate(workspaces: list[Path], seconds: float) -> ExecRate:
    """One coroutine per workspace, all sharing one launcher pool (as one runner)."""
    concurrency = len(workspaces)
    policies = [_policy(w) for w in workspaces]
    latencies: list[float] = []
    async with launcher_pool() as launchers:
        await asyncio.sleep(0.5)
        start = time.perf_counter()
        deadline = start + seconds

        async def loop(policy: Any) -> None:
            while time.perf_counter() < deadline:
                latencies.append(await _sandboxed(["true"], policy, launchers))

        await asyncio.gather(*(loop(p) for p in policies))
    return ExecRate(concurrency, len(latencies), time.perf_counter() - start, latencies)


# -- the round trip through the engine ------------------------------------------------------------
# Segments of tool_call (client) → tool_result (client), in order; they add up
# to the whole. Names are shown in the table's detail column.
SEGMENTS = (
    ("worker: snapshot after the model call", "to_tool_run"),
    ("worker: XADD → runner picks the job", "to_runner"),
    ("runner: claim row + workspace", "to_sandbox"),
    ("sandboxed exec (bash -c true)", "sandbox"),
    ("runner: complete row + XADD reply → worker has it", "after_sandbox"),
    ("worker: emit tool_result → gateway → client", "to_client"),
)


# Single steps inside those segments (each one PostgreSQL transaction but the
# XADD), by span: (label, span, key kind).
STEPS = (
    ("snapshot: events + message + state", "snapshot.write", "turn"),
    ("stored-check", "tool.stored", "call"),
    ("runner claim", "runner.claim", "call"),
    ("runner complete", "runner.complete", "call"),
)


@dataclass
class RoundTrips:
    round_trip_ms: list[float]
    segments_ms: dict[str, list[float]]
    steps_ms: dict[str, list[float]] = field(default_factory=dict)

    @property
    def p50(self) -> float:
        return percentile(self.round_trip_ms, 50)

    @property
    def p99(self) -> float:
        return percentile(self.round_trip_ms, 99)


def _segments(got: Frames, call_id: str, spans: Spans) -> dict[str, float] | None:
    call = got.first("tool_call")
    result = got.first("tool_result")
    run = spans.of(call_id, "tool.run")
    handle = spans.of(call_id, "runner.handle")
    sandbox = spans.of(call_id, "runner.sandbox")
    if not (call and result and run and handle and sandbox):
        return None
    t0, t1 = call[0], result[0]
    (run0, run1), (h0, _h1), (s0, s1) = run[0], handle[0], sandbox[0]
    return {
        "to_tool_run": run0 - t0,
        "to_runner": h0 - run0,
        "to_sandbox": s0 - h0,
        "sandbox": s1 - s0,
        # The runner's handle() also awaits its XADD reply, which the worker may
        # already have read: measured to the worker's side instead.
        "after_sandbox": run1 - s1,
        "to_client": t1 - run1,
    }


async def round_trips(
    url: str, key: str, turns: int, spans: Spans | None, warmup: int = 5
) -> RoundTrips:
    """Sequential turns on new tasks, one ``bash true`` call each."""
    done: list[tuple[Frames, str]] = []
    async with new_client() as client:
        for i in range(warmup + turns):
            got = await stream_frames(
                client, "POST", f"{url}/execute", key=key, json_body={"message": TOOL_SCRIPT}
            )
            call, result = got.first("tool_call"), got.first("tool_result")
            if got.phase != "completed" or call is None or result is None:
                raise StreamError(f"tool turn ended {got.phase!r}: {got.types()}")
            if result[1].get("error") is not None:
                raise StreamError(f"the bash call failed: {result[1].get('error')}")
            if i >= warmup:
                done.append((got, call[1]["tool_call_id"]))
    out = RoundTrips([], {name: [] for _, name in SEGMENTS})
    if spans is not None:
        spans.reload()
    for got, call_id in done:
        call, result = got.first("tool_call"), got.first("tool_result")
        assert call is not None and result is not None
        out.round_trip_ms.append((result[0] - call[0]) * 1000)
        parts = _segments(got, call_id, spans) if spans is not None else None
        if parts is not None:
            for name, value in parts.items():
                out.segments_ms[name].append(value * 1000)
        if spans is None:
            continue
        for label, span, kind in STEPS:
            found = spans.of(call_id if kind == "call" else got.turn_id or "", span)
            if found:  # the first: the turn's own model call, before its tool call
                out.steps_ms.setdefault(label, []).append((found[0][1] - found[0][0]) * 1000)
    return out
