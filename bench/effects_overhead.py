"""What the tool-effects machinery (#26: effect classes, idempotency keys, numbered
attempts) costs a tool call's round trip, measured against the code before it in
one run.

    git worktree add --detach /tmp/fx/before <commit before the machinery>
    git worktree add --detach /tmp/fx/today HEAD
    uv run --no-sync python -m bench.effects_overhead \\
        --variant before=/tmp/fx/before --variant today=/tmp/fx/today [--turns 200]

Each variant is a checkout of the engine. Its gateway, loop-worker and tool-runner
run its own code (``PYTHONPATH`` puts its packages before this environment's
editable installs; checked by importing them), on a database migrated by its own
migrations and a Redis prefix of its own, all on the same Redis and PostgreSQL
servers. The turns then take turns: each round runs one turn on every variant, the
order rotated each round, so a change in the machine's load (other people's test
suites on a shared 2-core VM) falls on every variant alike instead of on whichever
ran last. A turn is the bench's tool round trip (``bench.tools``): a new task, one
``bash true`` call; the client times the ``tool_call`` frame to the ``tool_result``
frame; the CPU time its processes used per turn (with the children they reaped, the
sandboxed execs among them) is read from ``/proc`` around the measured rounds. The
first variant is the baseline: the others' p50 minus its p50, the median
of the per-round differences, and a bootstrap 95 % interval of the p50 difference
(how far apart two p50s of these samples land by chance). Load average and the
machine's CPU busy share over the run come with it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg

from bench.scenarios import new_client, percentile
from bench.sse import StreamError, stream_frames
from bench.tools import TOOL_SCRIPT
from holdfast.testing import EngineEnvironment
from holdfast.testing.database import drop_database, libpq_url, with_database
from holdfast.testing.processes import Kind

# Where a checkout keeps each package's import root.
PACKAGES = (
    "src",
    "shared",
    "services/gateway",
    "services/loop-worker",
    "services/tool-runner",
    "services/learning",
)
# Started in this order: a worker finds a runner, a gateway a worker.
KINDS: tuple[Kind, ...] = ("tool-runner", "loop-worker", "gateway")
MODULES = ("holdfast", "holdfast_shared", "holdfast_loop_worker", "holdfast_tool_runner")
_BOOTSTRAP = 2000


@dataclass
class Variant:
    name: str
    root: Path
    database: str = ""
    engine: EngineEnvironment | None = None
    samples_ms: list[float] = field(default_factory=list)
    # CPU its processes (and the children they reaped: the sandboxed execs) used
    # per round, in ms: the machinery's work, which the load stretches less than
    # the wall-clock round trip.
    cpu_ms_per_turn: float = 0.0

    def cpu_seconds(self) -> float:
        assert self.engine is not None
        return sum(_process_cpu(process.pid) for process in self.engine.processes)

    @property
    def pythonpath(self) -> str:
        return os.pathsep.join(str(self.root / package) for package in PACKAGES)

    def run(self, *argv: str) -> str:
        env = {**os.environ, "PYTHONPATH": self.pythonpath}
        done = subprocess.run(
            [sys.executable, *argv], env=env, check=True, capture_output=True, text=True
        )
        return done.stdout

    def check_imports(self) -> None:
        """Its processes import its own packages, not this environment's."""
        code = (
            "import importlib, sys\n"
            "for m in sys.argv[1:]: print(importlib.import_module(m).__file__)"
        )
        for path in self.run("-c", code, *MODULES).split():
            if not Path(path).resolve().is_relative_to(self.root.resolve()):
                raise SystemExit(f"{self.name}: {path} is not under {self.root}")

    def migrate(self, postgres_url: str, name: str) -> str:
        with psycopg.connect(libpq_url(postgres_url), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self.database = name
        url = with_database(postgres_url, name)
        self.run(
            "-c",
            "import sys\nfrom holdfast_shared.db import upgrade_head\nupgrade_head(sys.argv[1])",
            url,
        )
        return url


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _process_cpu(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid``, in seconds."""
    after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # Fields 14-17 of stat(5); after the name, the state is field 3.
    ticks = sum(int(v) for v in after_name[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


async def _round_trip(client: httpx.AsyncClient, url: str, key: str) -> float:
    got = await stream_frames(
        client, "POST", f"{url}/execute", key=key, json_body={"message": TOOL_SCRIPT}
    )
    call, result = got.first("tool_call"), got.first("tool_result")
    if got.phase != "completed" or call is None or result is None:
        raise StreamError(f"tool turn ended {got.phase!r}: {got.types()}")
    if result[1].get("error") is not None:
        raise StreamError(f"the bash call failed: {result[1].get('error')}")
    return (result[0] - call[0]) * 1000


async def _rounds(variants: list[Variant], turns: int, warmup: int) -> None:
    cpu_start: dict[str, float] = {}
    async with new_client() as client:
        for i in range(warmup + turns):
            if i == warmup:
                cpu_start = {v.name: v.cpu_seconds() for v in variants}
            shift = i % len(variants)
            for variant in variants[shift:] + variants[:shift]:
                engine = variant.engine
                assert engine is not None
                ms = await _round_trip(client, engine.url, engine.api_key)
                if i >= warmup:
                    variant.samples_ms.append(ms)
    for variant in variants:
        used = variant.cpu_seconds() - cpu_start[variant.name]
        variant.cpu_ms_per_turn = 1000 * used / max(1, turns)


def _p50_interval(base: list[float], other: list[float]) -> tuple[float, float]:
    """A bootstrap 95 % interval of p50(other) - p50(base)."""
    rng = random.Random(26)
    deltas = sorted(
        percentile(rng.choices(other, k=len(other)), 50)
        - percentile(rng.choices(base, k=len(base)), 50)
        for _ in range(_BOOTSTRAP)
    )
    return deltas[int(0.025 * _BOOTSTRAP)], deltas[int(0.975 * _BOOTSTRAP) - 1]


def report(variants: list[Variant], load: tuple[float, float], busy: float, seconds: float) -> None:
    base = variants[0]
    print(
        f"\n{len(base.samples_ms)} rounds in {seconds:.0f} s; load average (1 min) "
        f"{load[0]:.2f} at the start, {load[1]:.2f} at the end; machine CPU busy "
        f"{busy:.0f}% of {100 * (os.cpu_count() or 1)}% over the run\n"
    )
    print(
        "| variant | p50 ms | p99 ms | p50 - baseline | median per-round difference | "
        "95 % interval of the p50 difference | CPU ms per turn |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for variant in variants:
        p50 = percentile(variant.samples_ms, 50)
        p99 = percentile(variant.samples_ms, 99)
        if variant is base:
            print(
                f"| {variant.name} (baseline) | {p50:.1f} | {p99:.1f} | | | | "
                f"{variant.cpu_ms_per_turn:.1f} |"
            )
            continue
        paired = sorted(o - b for o, b in zip(variant.samples_ms, base.samples_ms, strict=True))
        low, high = _p50_interval(base.samples_ms, variant.samples_ms)
        print(
            f"| {variant.name} | {p50:.1f} | {p99:.1f} | "
            f"{p50 - percentile(base.samples_ms, 50):+.1f} ms | "
            f"{paired[len(paired) // 2]:+.1f} ms | {low:+.1f} to {high:+.1f} ms | "
            f"{variant.cpu_ms_per_turn:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=CHECKOUT")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--redis-url", default=os.environ.get("HOLDFAST_TEST_REDIS_URL"))
    parser.add_argument("--postgres-url", default=os.environ.get("HOLDFAST_TEST_DATABASE_URL"))
    options = parser.parse_args()
    if not options.redis_url or not options.postgres_url:
        raise SystemExit("--redis-url and --postgres-url (or HOLDFAST_TEST_*_URL) are needed")
    variants = []
    for spec in options.variant:
        name, _, root = spec.partition("=")
        variants.append(Variant(name, Path(root)))
    tag = f"{os.getpid()}"
    try:
        for variant in variants:
            variant.check_imports()
            url = variant.migrate(options.postgres_url, f"fx_{tag}_{variant.name}")
            variant.engine = EngineEnvironment(
                redis_url=options.redis_url,
                database_url=url,
                name=f"fx{variant.name}",
                env={
                    "PYTHONPATH": variant.pythonpath,
                    "HOLDFAST_LOG_LEVEL": "WARNING",
                    "HOLDFAST_TOOL_PERMISSIONS": '{"*": {"bash": "allow"}}',
                },
            )
            for kind in KINDS:
                variant.engine.start(kind)
            print(f"{variant.name}: {variant.root} ready at {variant.engine.url}")
        load_start = os.getloadavg()[0]
        busy0, total0 = _cpu_times()
        started = time.monotonic()
        asyncio.run(_rounds(variants, options.turns, options.warmup))
        seconds = time.monotonic() - started
        busy1, total1 = _cpu_times()
        busy = 100 * (os.cpu_count() or 1) * (busy1 - busy0) / max(1, total1 - total0)
        report(variants, (load_start, os.getloadavg()[0]), busy, seconds)
    finally:
        for variant in variants:
            if variant.engine is not None:
                variant.engine.close()
            if variant.database:
                drop_database(options.postgres_url, variant.database)


if __name__ == "__main__":
    main()
