"""Trajectory retention: PostgreSQL for a month, compressed files for a year.

The reference's "typical policy", as settings: a trajectory older than
``HOLDFAST_TRAJECTORY_RETENTION_DAYS`` (30) is appended to the day it
finished on — ``<dir>/YYYY/MM/trajectories-YYYY-MM-DD.ndjson.gz``, one JSON
object per line, each batch a gzip member of its own (a gzip file of
several members is one valid stream) — and then deleted from PostgreSQL;
day files older than ``HOLDFAST_TRAJECTORY_ARCHIVE_DAYS`` (365) are deleted.

Learned memories stay: only the raw record goes. A crash between writing a
batch and deleting its rows is harmless: the next run skips the ids the day
file already holds.

Every function takes ``now``, so tests move the clock instead of waiting.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
from collections.abc import Iterable
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any

from holdfast_shared.db.models import TrajectoryRecord
from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

_BATCH = 1000
_DAY_FILE = re.compile(r"^trajectories-(\d{4}-\d{2}-\d{2})\.ndjson\.gz$")


def day_file(directory: Path, day: date) -> Path:
    return directory / f"{day:%Y}" / f"{day:%m}" / f"trajectories-{day.isoformat()}.ndjson.gz"


def _row_json(row: TrajectoryRecord) -> dict[str, Any]:
    return {
        "id": row.id,
        "tenant_id": row.tenant_id,
        "user_id": row.user_id,
        "task_id": row.task_id,
        "outcome": row.outcome,
        "status": row.status,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "started_at": row.started_at.isoformat(),
        "finished_at": row.finished_at.isoformat(),
        "processed_at": row.processed_at.isoformat() if row.processed_at else None,
        "record": row.record,
    }


def read_day(path: Path) -> list[dict[str, Any]]:
    """Every trajectory in a day file (tests and restores read it back this way)."""
    if not path.exists():
        return []
    with gzip.open(path, "rt", encoding="utf-8") as stream:
        return [json.loads(line) for line in stream if line.strip()]


def _append(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    """Append the rows whose id the file lacks; returns how many (blocking: run in a thread)."""
    have = {item["id"] for item in read_day(path)}
    lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in rows if r["id"] not in have]
    if not lines:
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb") as stream:
            stream.write("".join(lines).encode())
        raw.flush()
        os.fsync(raw.fileno())
    return len(lines)


async def archive_trajectories(
    sessions: async_sessionmaker[AsyncSession],
    directory: Path,
    *,
    retention_days: int,
    now: datetime,
) -> int:
    """Move trajectories past their retention into day files; returns how many moved."""
    cutoff = now - timedelta(days=retention_days)
    moved = 0
    while True:
        async with sessions() as session:
            rows = list(
                (
                    await session.execute(
                        select(TrajectoryRecord)
                        .where(TrajectoryRecord.finished_at < cutoff)
                        .order_by(TrajectoryRecord.finished_at)
                        .limit(_BATCH)
                    )
                ).scalars()
            )
        if not rows:
            return moved
        by_day: dict[date, list[dict[str, Any]]] = {}
        for row in rows:
            by_day.setdefault(row.finished_at.date(), []).append(_row_json(row))
        for day, items in by_day.items():
            await asyncio.to_thread(_append, day_file(directory, day), items)
        async with sessions.begin() as session:
            await session.execute(
                delete(TrajectoryRecord).where(TrajectoryRecord.id.in_([r.id for r in rows]))
            )
        moved += len(rows)


def _expired_files(directory: Path, before: date) -> list[Path]:
    if not directory.exists():
        return []
    found = []
    for path in directory.rglob("trajectories-*.ndjson.gz"):
        match = _DAY_FILE.match(path.name)
        if match and date.fromisoformat(match.group(1)) < before:
            found.append(path)
    return found


async def delete_old_archives(directory: Path, *, archive_days: int, now: datetime) -> int:
    """Delete day files older than ``archive_days``; returns how many."""
    expired = await asyncio.to_thread(
        _expired_files, directory, (now - timedelta(days=archive_days)).date()
    )
    for path in expired:
        await asyncio.to_thread(path.unlink, True)
    return len(expired)
