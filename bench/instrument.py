"""Timing spans recorded inside real engine processes, for the bench's breakdowns.

A loop-worker or tool-runner started through :func:`worker_main` /
:func:`runner_main` is the real service with timing wrappers put around a few
of its functions at start-up (no engine file is changed; a function that no
longer exists is skipped). Each finished call appends one JSON line
``{"span", "key", "start", "end"}`` to ``<HOLDFAST_BENCH_SPANS>/<pid>.jsonl``.
``start``/``end`` are ``time.perf_counter()`` values: CLOCK_MONOTONIC on
Linux, one clock for every process on the machine, so they line up with the
bench client's own timestamps. ``key`` ties a span to a turn (its turn id) or
a tool call (its call id).

The overhead is one ``perf_counter`` pair and one small ``write`` per wrapped
call: a few microseconds, on calls that take milliseconds.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ENV = "HOLDFAST_BENCH_SPANS"

_file: Any = None
# The span a nested wrapper reports under (e.g. the emitter drain inside a snapshot).
_outer: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "bench_outer", default=None
)


def _record(span: str, key: str, start: float, end: float) -> None:
    global _file
    if _file is None:
        directory = os.environ.get(ENV)
        if not directory:
            return
        _file = open(Path(directory) / f"{os.getpid()}.jsonl", "a", buffering=1)
    _file.write(json.dumps({"span": span, "key": key, "start": start, "end": end}) + "\n")


def _wrap(
    owner: Any,
    attr: str,
    span: str | Callable[..., str],
    key: Callable[..., str | None],
    *,
    outer: bool = False,
    only_inside: str | None = None,
) -> None:
    """Time ``owner.attr`` (an async function) as ``span`` (or ``span(*args, **kwargs)``).

    ``key(*args, **kwargs)`` names what the call belongs to; ``outer`` makes
    the call the parent of nested spans; ``only_inside`` records the call
    only when it runs inside that parent span (and under the parent's key).
    """
    original = getattr(owner, attr, None)
    if original is None:
        return

    @functools.wraps(original)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        parent = _outer.get()
        if only_inside is not None and (parent is None or parent[0] != only_inside):
            return await original(*args, **kwargs)
        k = parent[1] if only_inside is not None and parent else key(*args, **kwargs) or ""
        name = span if isinstance(span, str) else span(*args, **kwargs)
        token = _outer.set((name, k)) if outer else None
        start = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            end = time.perf_counter()
            if token is not None:
                _outer.reset(token)
            _record(name, k, start, end)

    setattr(owner, attr, wrapper)


def _install_worker() -> None:
    from holdfast_loop_worker import toolcalls, turn
    from holdfast_loop_worker.turn import model_step, resume
    from holdfast_shared.eventlog import Emitter, EventLog

    runner = turn.TurnRunner
    # Steps are module functions taking the turn's handle (run.py calls them
    # through their modules, so wrapping the module attribute catches them).
    _wrap(turn.LiveTurn, "snapshot", "snapshot", lambda self, *a, **k: self.job.turn_id, outer=True)
    _wrap(Emitter, "drain", "snapshot.drain", lambda *a, **k: None, only_inside="snapshot")
    # One transaction: the task's unarchived events, the step's message, the state.
    _wrap(EventLog, "archive_now", "snapshot.write", lambda *a, **k: None, only_inside="snapshot")
    _wrap(model_step, "model_step", "model_step", lambda t, *a, **k: t.job.turn_id)
    _wrap(resume, "announce_resume", "announce_resume", lambda t, *a, **k: t.job.turn_id)
    _wrap(runner, "run", "turn", lambda self, *a, **k: self.job.turn_id)
    caller = toolcalls.ToolCaller
    _wrap(caller, "run", "tool.run", lambda self, ctx, call_id, *a, **k: call_id, outer=True)
    _wrap(caller, "stored", "tool.stored", lambda *a, **k: None, only_inside="tool.run")

    # Each append of a batch of events, keyed by turn: "append.text" when the
    # batch carries text deltas.
    def append_span(self: Any, task_id: str, turn_id: str, bodies: Any, *a: Any, **k: Any) -> str:
        return "append.text" if any(t == "text_delta" for t, _ in bodies) else "append"

    _wrap(EventLog, "append_bodies", append_span, lambda self, task_id, turn_id, *a, **k: turn_id)


def _install_runner() -> None:
    from holdfast_tool_runner import builtin
    from holdfast_tool_runner.executor import ToolExecutor

    def call_id(self: Any, job: Any, *a: Any, **k: Any) -> str:
        return str(job.tool_call_id)

    _wrap(ToolExecutor, "handle", "runner.handle", call_id, outer=True)
    _wrap(ToolExecutor, "_claim", "runner.claim", call_id)
    _wrap(ToolExecutor, "_run", "runner.run", call_id)
    _wrap(ToolExecutor, "_complete", "runner.complete", call_id)
    _wrap(
        builtin,
        "run_sandboxed",
        "runner.sandbox",
        lambda *a, **k: None,
        only_inside="runner.handle",
    )


def worker_main() -> None:
    """Entry point of an instrumented loop-worker process."""
    _install_worker()
    from holdfast_loop_worker.main import main

    main()


def runner_main() -> None:
    """Entry point of an instrumented tool-runner process."""
    _install_runner()
    from holdfast_tool_runner.main import main

    main()


WORKER_CODE = "from bench.instrument import worker_main; worker_main()"
RUNNER_CODE = "from bench.instrument import runner_main; runner_main()"


# -- reading the spans back (bench side) -------------------------------------------------
class Spans:
    """Every span the instrumented processes wrote into ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.by_key: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        self.all: dict[str, list[tuple[str, float, float]]] = defaultdict(list)
        self.reload()

    def reload(self) -> Spans:
        self.by_key.clear()
        self.all.clear()
        for path in sorted(self.directory.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a SIGKILL
                self.by_key[rec["key"]][rec["span"]].append((rec["start"], rec["end"]))
                self.all[rec["span"]].append((rec["key"], rec["start"], rec["end"]))
        return self

    def durations_ms(
        self,
        span: str,
        keys: Iterable[str] | None = None,
        window: tuple[float, float] | None = None,
    ) -> list[float]:
        """Durations of ``span`` (of these keys; started inside ``window``)."""
        wanted = None if keys is None else set(keys)
        lo, hi = window or (-math.inf, math.inf)
        return [
            (end - start) * 1000
            for key, start, end in self.all.get(span, [])
            if (wanted is None or key in wanted) and lo <= start <= hi
        ]

    def of(self, key: str, span: str) -> list[tuple[float, float]]:
        return sorted(self.by_key.get(key, {}).get(span, []))
