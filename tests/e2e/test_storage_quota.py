"""``HOLDFAST_TENANT_MAX_STORAGE_BYTES``: a tenant whose stored bytes reach the limit
gets 507 STORAGE_QUOTA_EXCEEDED on its next new turn (and memory import), with
nothing written; other tenants are unaffected (real gateway and worker)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import httpx
import pytest
from holdfast_shared.db.models import EventRecord, Task, Turn
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing.database import add_api_key
from tests.conftest import engine_env
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute
from tests.waiting import until

pytestmark = [pytest.mark.timeout(240)]

LIMIT = 6000
# One turn logs a text this long (and its deltas): two or three pass the limit.
BIG = "/script " + json.dumps({"text": "x" * 2000, "deltas": 4})


@pytest.fixture(scope="module")
def quota_engine(
    redis_url: str, database_url: str, redis_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcesses]:
    prefix = f"{redis_prefix}quota-{secrets.token_hex(3)}:"
    env = engine_env(
        redis_url,
        database_url,
        prefix,
        HOLDFAST_TENANT_MAX_STORAGE_BYTES=str(LIMIT),
        HOLDFAST_STORAGE_USAGE_REFRESH_SECONDS="0.2",
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("quota")) as procs:
        yield procs


async def _counts(sessions: async_sessionmaker[AsyncSession], tenant: str) -> tuple[int, ...]:
    async with sessions() as session:
        tasks = await session.scalar(
            select(func.count()).select_from(Task).where(Task.tenant_id == tenant)
        )
        turns = await session.scalar(
            select(func.count())
            .select_from(Turn)
            .join(Task, Task.id == Turn.task_id)
            .where(Task.tenant_id == tenant)
        )
        events = await session.scalar(
            select(func.count())
            .select_from(EventRecord)
            .join(Task, Task.id == EventRecord.task_id)
            .where(Task.tenant_id == tenant)
        )
    return int(tasks or 0), int(turns or 0), int(events or 0)


async def test_over_the_limit_new_writes_get_507_and_write_nothing(
    quota_engine: EngineProcesses,
    database_url: str,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    tenant = f"tenant-quota-{secrets.token_hex(3)}"
    key = add_api_key(database_url, tenant)
    other = add_api_key(database_url, f"tenant-quota-other-{secrets.token_hex(3)}")
    base = quota_engine.url
    task = f"quota-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=60) as client:
        # Turns until the archived log passes the limit and the cached figure
        # (0.2 s) sees it: a bound on attempts, not on time.
        refused = None
        logged = 0  # events the task's turns streamed
        for _ in range(200):
            got = await execute(client, base, key, {"message": BIG, "task_id": task})
            if got.status == 507:
                refused = got
                break
            assert got.status == 200, got.body
            assert got.events[-1]["phase"] == "completed"
            logged = got.events[-1]["seq"]
        assert refused is not None, "never refused"
        body = refused.body
        assert body["error"] == "STORAGE_QUOTA_EXCEEDED"
        assert body["details"]["limit_bytes"] == LIMIT
        assert body["details"]["used_bytes"] >= LIMIT

        # The last turn's events reach PostgreSQL a moment after its end (the
        # event copier): counted once they are all there.
        async def copied() -> bool:
            return (await _counts(sessions, tenant))[2] == logged

        await until(copied, "the task's events copied to PostgreSQL")
        before = await _counts(sessions, tenant)
        again = await execute(client, base, key, {"message": "hi", "task_id": task})
        fresh = f"quota-new-{secrets.token_hex(3)}"
        new_task = await execute(client, base, key, {"message": "hi", "task_id": fresh})
        queued = await execute(
            client, base, key, {"message": "hi", "task_id": task, "on_busy": "enqueue"}
        )
        imported = await client.post(
            f"{base}/memory/import",
            headers={"X-Engine-Key": key, "Content-Type": "application/x-ndjson"},
            content=b"",
        )
        assert [r.status for r in (again, new_task, queued)] == [507, 507, 507]
        assert imported.status_code == 507, imported.text
        assert imported.json()["error"] == "STORAGE_QUOTA_EXCEEDED"
        # Nothing written by the refused requests: no task, no turn, no event.
        assert await _counts(sessions, tenant) == before
        async with sessions() as session:
            assert await session.scalar(select(Task.id).where(Task.name == fresh)) is None

        theirs = await execute(client, base, other, {"message": BIG, "task_id": task})
        assert theirs.status == 200 and theirs.events[-1]["phase"] == "completed"

        # Deleting the task frees the space: the next turn is accepted again.
        deleted = await client.delete(f"{base}/tasks/{task}", headers={"X-Engine-Key": key})
        assert deleted.status_code == 200, deleted.text
        for _ in range(200):
            back = await execute(client, base, key, {"message": "hi", "task_id": task})
            if back.status == 200:
                break
            assert back.status == 507
        assert back.status == 200 and back.events[-1]["phase"] == "completed"
