"""Workspace checkpoints: an incremental checkpoint of a 50 MB workspace with 1 % of it
changed, as a fraction of a full archive's bytes and time (target ≤ 10 %), and
restoring that workspace in place to the earlier archive — a rollback — (target
p50 ≤ 1 s), on each store: PostgreSQL (the bench database) and a directory.

In process, through ``holdfast_shared.workspace_checkpoints`` exactly as the
tool-runner calls it (the Redis request and reply around it add one round trip).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from holdfast_shared.db import create_engine, session_factory
from holdfast_shared.db.models import Task, Tenant
from holdfast_shared.ids import new_task_id
from holdfast_shared.workspace_checkpoints import ArchiveStore, DirectoryStore, PostgresStore
from holdfast_tool_runner.workspace_tree import checkpoint, restore
from sqlalchemy.dialects.postgresql import insert

from bench import scenarios
from bench.context import Context, run_async
from bench.table import Row

WORKSPACE_BYTES = 50 * 1024 * 1024
CHANGED_FRACTION = 0.01
ROLLBACKS = 7
TARGET_RATIO = 0.10
TARGET_ROLLBACK_S = 1.0
TENANT = "bench-workspaces"


@dataclass
class Measured:
    files: int
    total_bytes: int
    changed_files: int
    changed_bytes: int
    full_s: float
    full_stored: int
    incremental_s: float
    incremental_stored: int
    incremental_read: int
    rollback_s: list[float]
    fresh_s: list[float]


def make_workspace(root: Path, seed: int = 7) -> list[Path]:
    """About 50 MB in mixed files: many small text-like ones, some medium, a few
    large half-random ones, in nested directories; the files, in order."""
    rng = random.Random(seed)
    words = [f"word{i}" for i in range(500)]
    files: list[Path] = []
    total = 0
    index = 0
    while total < WORKSPACE_BYTES:
        kind = rng.random()
        if kind < 0.90:
            size = rng.randint(200, 16 * 1024)
        elif kind < 0.995:
            size = rng.randint(32 * 1024, 256 * 1024)
        else:
            size = rng.randint(1024 * 1024, 4 * 1024 * 1024)
        directory = root / f"pkg{index % 23}" / f"mod{index % 7}"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"file{index}.txt"
        text = " ".join(rng.choices(words, k=size // 6)).encode()[: size // 2]
        path.write_bytes(text + rng.randbytes(size - len(text)))
        files.append(path)
        total += size
        index += 1
    return files


def change_some(files: list[Path], seed: int = 11) -> tuple[int, int]:
    """Rewrite about 1 % of the workspace's bytes (small and medium files); how
    many files and bytes."""
    rng = random.Random(seed)
    budget = int(WORKSPACE_BYTES * CHANGED_FRACTION)
    changed = changed_bytes = 0
    for path in rng.sample(files, len(files)):
        size = path.stat().st_size
        if size > budget - changed_bytes or size > 512 * 1024:
            continue
        path.write_bytes(rng.randbytes(size))
        changed += 1
        changed_bytes += size
        if changed_bytes >= budget * 0.9:
            break
    return changed, changed_bytes


async def measure(store: ArchiveStore, tenant: str, task: str, scratch: Path) -> Measured:
    root = scratch / "workspace"
    files = make_workspace(root)
    total = sum(p.stat().st_size for p in files)
    started = time.perf_counter()
    full = await checkpoint(store, tenant, task, root, reason="bench")
    full_s = time.perf_counter() - started
    changed, changed_bytes = change_some(files)
    started = time.perf_counter()
    incremental = await checkpoint(
        store, tenant, task, root, previous=full.manifest, previous_id=full.archive_id
    )
    incremental_s = time.perf_counter() - started
    # Rollback: back to the full archive, in place, then forward again, alternating.
    rollback_s: list[float] = []
    here, there = incremental.manifest, full.manifest
    for _ in range(ROLLBACKS):
        started = time.perf_counter()
        await restore(store, tenant, root, there, previous=here)
        rollback_s.append(time.perf_counter() - started)
        here, there = there, here
    # A runner without the workspace (another machine, a wiped disk).
    fresh_s: list[float] = []
    for attempt in range(3):
        target = scratch / f"fresh{attempt}"
        started = time.perf_counter()
        await restore(store, tenant, target, full.manifest)
        fresh_s.append(time.perf_counter() - started)
        shutil.rmtree(target)
    return Measured(
        files=len(files),
        total_bytes=total,
        changed_files=changed,
        changed_bytes=changed_bytes,
        full_s=full_s,
        full_stored=full.bytes_stored,
        incremental_s=incremental_s,
        incremental_stored=incremental.bytes_stored,
        incremental_read=incremental.bytes_read,
        rollback_s=rollback_s,
        fresh_s=fresh_s,
    )


async def _run_store(kind: str, database_url: str) -> Measured:
    engine = create_engine(database_url, pool_size=2)
    sessions = session_factory(engine)
    task = new_task_id()
    try:
        async with sessions.begin() as session:
            await session.execute(
                insert(Tenant).values(id=TENANT, name="bench").on_conflict_do_nothing()
            )
            session.add(Task(id=task, tenant_id=TENANT, name=task))
        with tempfile.TemporaryDirectory(prefix="bench-ws-") as scratch:
            store: ArchiveStore
            if kind == "PostgreSQL":
                store = PostgresStore(sessions)
            else:
                store = DirectoryStore(Path(scratch) / "store")
            return await measure(store, TENANT, task, Path(scratch))
    finally:
        await engine.dispose()


def _rows(kind: str, m: Measured) -> list[Row]:
    pct = scenarios.percentile
    byte_ratio = m.incremental_stored / max(1, m.full_stored)
    time_ratio = m.incremental_s / max(1e-9, m.full_s)
    mb = 1024 * 1024
    rollback_p50 = pct([s * 1000 for s in m.rollback_s], 50) / 1000
    return [
        Row(
            f"Workspace checkpoint, 1 % changed ({kind})",
            f"{byte_ratio:.1%} of the bytes\n{time_ratio:.1%} of the time",
            base=f"full: {m.full_stored / mb:.1f} MB stored in {m.full_s:.2f} s",
            target=f"≤ {TARGET_RATIO:.0%} of both",
            detail=f"{m.files:,} files, {m.total_bytes / mb:.1f} MB (90 % of files ≤ 16 kB, "
            f"0.5 % of 1-4 MB; half text, half random bytes). {m.changed_files} files "
            f"({m.changed_bytes / 1024:.0f} kB) rewritten: the incremental checkpoint read "
            f"{m.incremental_read / 1024:.0f} kB, stored {m.incremental_stored / 1024:.0f} kB "
            f"of new zstd blobs in {m.incremental_s * 1000:.0f} ms (every other file only "
            f"stat()ed: size and mtime match the previous manifest).",
            ok=byte_ratio <= TARGET_RATIO and time_ratio <= TARGET_RATIO,
        ),
        Row(
            f"Workspace rollback to a checkpoint, 50 MB ({kind})",
            f"p50 {rollback_p50 * 1000:.0f} ms\nmax {max(m.rollback_s) * 1000:.0f} ms",
            target=f"≤ {TARGET_ROLLBACK_S:g} s p50",
            detail=f"{len(m.rollback_s)} in-place restores alternating between the two "
            f"archives above (only the {m.changed_files} differing files are rewritten). "
            f"Restoring the whole workspace into an empty directory (a runner that lacks "
            f"it): p50 {pct([s * 1000 for s in m.fresh_s], 50):.0f} ms.",
            ok=rollback_p50 <= TARGET_ROLLBACK_S,
        ),
    ]


def _runner(kind: str, database_url: str) -> Callable[[], Coroutine[Any, Any, Measured]]:
    return lambda: _run_store(kind, database_url)


def run(ctx: Context) -> list[Row]:
    rows: list[Row] = []
    for kind in ("PostgreSQL", "directory"):
        label = f"Workspace checkpoint and rollback ({kind})"
        ctx.say(f"{label}: a {WORKSPACE_BYTES // (1024 * 1024)} MB workspace")
        with ctx.errors_to(rows, label):
            measured = run_async(_runner(kind, ctx.engine.database_url), False)
            rows.extend(_rows(kind, measured))
    return rows


if __name__ == "__main__":  # a quick look without the bench's engine
    import asyncio

    url = os.environ["HOLDFAST_DATABASE_URL"]
    for kind in ("PostgreSQL", "directory"):
        for row in _rows(kind, asyncio.run(_run_store(kind, url))):
            print(row.label, "|", row.result.replace("\n", " / "), "|", row.base, "|", row.detail)
