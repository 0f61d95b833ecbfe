"""Schedules through real gateways: each due time fired exactly once by two
gateways racing for it, with the scheduler's clock moved (the test-only
``HOLDFAST_SCHEDULE_CLOCK_OFFSET_SECONDS``) seconds before a DST change; the
catch-up of due times every process was down across (a fall-back night
among them); and the API's answers to bad input."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Message, ScheduleRun, Task, Turn
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing import time_scale
from tests.conftest import engine_env
from tests.isolation import (  # noqa: F401 (fixtures)
    fresh_tenant_keys,
    own_api_keys,
    own_database_url,
)
from tests.processes import EngineProcesses, engine_from_env
from tests.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

Sessions = async_sessionmaker[AsyncSession]
OFFSET = "HOLDFAST_SCHEDULE_CLOCK_OFFSET_SECONDS"


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


def offset_to(moment: datetime) -> dict[str, str]:
    """A gateway's env whose scheduler clock reads ``moment`` now."""
    return {OFFSET: str(moment.timestamp() - time.time())}


@pytest.fixture
def procs(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path: Path,
) -> Iterator[EngineProcesses]:
    """An engine with nothing started: each test starts its gateways with its clock."""
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}schedules-{tmp_path.name}:",
        HOLDFAST_SCHEDULE_CATCH_UP_MAX="2",
    )
    with engine_from_env(env, tmp_path) as engine:
        yield engine


def start_gateways(procs: EngineProcesses, count: int, clock: datetime) -> list[str]:
    """``count`` gateways started at once, their clocks reading ``clock`` now."""
    env = offset_to(clock)
    started = [procs.start("gateway", env=env, wait=False) for _ in range(count)]
    procs.wait_ready(*started)
    return [process.url for process in started if process.url]


class Api:
    def __init__(self, client: httpx.AsyncClient, base: str, key: str) -> None:
        self.client, self.base, self.key = client, base, key

    async def call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return await self.client.request(
            method, f"{self.base}{path}", json=body, headers={"X-Engine-Key": self.key}
        )

    async def create(self, **body: Any) -> dict[str, Any]:
        reply = await self.call("POST", "/schedules", body)
        assert reply.status_code == 201, reply.text
        created: dict[str, Any] = reply.json()
        return created

    async def runs(self, name: str) -> list[dict[str, Any]]:
        reply = await self.call("GET", f"/schedules/{name}/runs?limit=1000")
        assert reply.status_code == 200, reply.text
        runs: list[dict[str, Any]] = reply.json()["runs"]
        return runs[::-1]  # oldest first


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as http:
        yield http


def when(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value)


async def turns_of_runs(sessions: Sessions, names: list[str]) -> dict[str, int]:
    """How many turns each of these tasks has."""
    async with sessions() as session:
        rows = await session.execute(
            select(Task.name, func.count(Turn.id))
            .join(Turn, Turn.task_id == Task.id)
            .where(Task.name.in_(names))
            .group_by(Task.name)
        )
        return {name: count for name, count in rows}


async def test_two_gateways_fire_each_due_time_once_across_a_dst_change(
    procs: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    database_url: str,
    sessions: Sessions,
) -> None:
    # 2027-03-14, New York: 02:00 EST becomes 03:00 EDT. A daily 02:30 is due
    # at 03:00 EDT (07:00 UTC) that night; the clocks read a little before.
    dst_due = utc(2027, 3, 14, 7)
    margin = 20 * time_scale()
    procs.start_worker()
    for _ in range(3):
        started = [
            procs.start("gateway", env=offset_to(dst_due - timedelta(seconds=margin)), wait=False)
            for _ in range(2)
        ]
        procs.wait_ready(*started)
        base, other = (process.url or "" for process in started)
        api = Api(client, base, api_keys["main"])
        created = await api.create(
            name="nightly", cron="30 2 * * *", timezone="America/New_York", message="nightly"
        )
        if when(created["next_due_at"]) == dst_due:
            break
        # Their start took longer than the margin (a loaded machine): the clocks
        # passed the due time already. Again, with twice the margin.
        assert (await api.call("DELETE", "/schedules/nightly")).status_code == 204
        for process in started:
            procs.kill(process)
        margin *= 2
    else:
        pytest.fail(f"the gateways took longer than {margin / 2:.0f} s to start, three times")
    # On the other gateway, a schedule due every 2 s while both race for each
    # (catch_up all: a round late by a due time on this busy machine drops none).
    tick = await Api(client, other, api_keys["main"]).create(
        name="tick", interval_seconds=2, message="tick", overlap="enqueue", catch_up="all"
    )
    anchor = when(tick["next_due_at"])
    assert anchor is not None

    async def fired() -> bool:
        return any(run["status"] == "started" for run in await api.runs("nightly"))

    await until(fired, "the DST night's run", within=margin + 30)
    nightly = await api.runs("nightly")
    assert [(when(r["due_at"]), r["status"]) for r in nightly] == [(dst_due, "started")]
    assert when(nightly[0]["fired_at"]) - dst_due < timedelta(seconds=2)  # type: ignore[operator]
    again = (await api.call("GET", "/schedules/nightly")).json()
    assert when(again["next_due_at"]) == utc(2027, 3, 15, 6, 30)  # 02:30 EDT the next night

    # Every 2 s due time once, none missed, each started run one turn of its own task.
    async def five_ticks() -> bool:
        return len(await api.runs("tick")) >= 5

    await until(five_ticks, "five ticks", within=30)
    await api.call("POST", "/schedules/tick/pause")
    runs = await api.runs("tick")
    dues = [when(r["due_at"]) for r in runs]
    assert len(runs) >= 5
    assert dues == [anchor + timedelta(seconds=2 * k) for k in range(len(runs))]

    async def all_started() -> bool:
        runs[:] = await api.runs("tick")
        return all(r["status"] == "started" for r in runs)

    # Each a turn to start on an engine the clock test keeps busy: seconds apiece at load.
    await until(all_started, "the enqueued runs", within=60)
    tasks = [r["task_id"] for r in runs]
    assert len(set(tasks)) == len(tasks)
    assert await turns_of_runs(sessions, [*tasks, nightly[0]["task_id"]]) == dict.fromkeys(
        [*tasks, nightly[0]["task_id"]], 1
    )
    turn_ids = [r["turn_id"] for r in [*runs, *nightly]]
    async with sessions() as session:
        messages = await session.scalar(
            select(func.count(Message.id))
            .join(ScheduleRun, ScheduleRun.turn_id == Message.turn_id)
            .where(Message.role == "user", ScheduleRun.turn_id.in_(turn_ids))
        )
    assert messages == len(turn_ids)


async def test_catch_up_after_every_process_was_down_across_due_times(
    procs: EngineProcesses, api_keys: dict[str, str], client: httpx.AsyncClient
) -> None:
    # 2027-11-07, New York: 02:00 EDT becomes 01:00 EST; 01:30 happens twice.
    start = utc(2027, 11, 7, 5)  # 01:00 EDT
    procs.start_worker()
    (base,) = start_gateways(procs, 1, start)
    api = Api(client, base, api_keys["main"])
    zone = {"timezone": "America/New_York"}
    await api.create(name="night", cron="30 1 * * *", catch_up="all", message="n", **zone)
    await api.create(
        name="hourly-all", cron="0 * * * *", catch_up="all", overlap="enqueue", message="a", **zone
    )
    await api.create(name="hourly-latest", cron="0 * * * *", message="l", **zone)
    procs.kill_all()

    # Everything down until 03:50 EST: both 01:30s, and 01:00 EST to 03:00 EST, passed.
    procs.start_worker()
    (base,) = start_gateways(procs, 2, utc(2027, 11, 7, 8, 50))[:1]
    api = Api(client, base, api_keys["main"])
    expected = {
        # Once, at the first 01:30: the night repeats it, the schedule does not.
        "night": [utc(2027, 11, 7, 5, 30)],
        # The latest HOLDFAST_SCHEDULE_CATCH_UP_MAX (2) of 06:00, 07:00, 08:00.
        "hourly-all": [utc(2027, 11, 7, 7), utc(2027, 11, 7, 8)],
        "hourly-latest": [utc(2027, 11, 7, 8)],
    }

    async def caught_up() -> bool:
        for name, dues in expected.items():
            runs = await api.runs(name)
            if [when(r["due_at"]) for r in runs] != dues:
                return False
            if any(r["status"] != "started" for r in runs):
                return False
        return True

    await until(caught_up, "the catch-up runs", within=30)
    night = (await api.call("GET", "/schedules/night")).json()
    assert when(night["next_due_at"]) == utc(2027, 11, 8, 6, 30)  # 01:30 EST
    hourly = (await api.call("GET", "/schedules/hourly-all")).json()
    assert when(hourly["next_due_at"]) == utc(2027, 11, 7, 9)


async def test_the_api_refuses_bad_schedules(
    procs: EngineProcesses, tenant_keys: dict[str, str], client: httpx.AsyncClient
) -> None:
    (base,) = start_gateways(procs, 1, datetime.now(UTC))
    # Tenants of this test alone: the module's others have schedules of their own.
    api = Api(client, base, tenant_keys["main"])
    other = Api(client, base, tenant_keys["other"])
    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()
    bad = [
        {"name": "b", "message": "m"},
        {"name": "b", "message": "m", "cron": "0 9 * * *", "interval_seconds": 60},
        {"name": "b", "message": "m", "cron": "0 9 * *"},
        {"name": "b", "message": "m", "cron": "0 25 * * *"},
        {"name": "b", "message": "m", "cron": "0 9 * * *", "timezone": "Mars/Olympus"},
        {"name": "b", "message": "m", "at": "2001-01-01T00:00:00Z"},
        {"name": "b", "message": "m", "interval_seconds": 0},
        {"name": "b", "message": "m", "at": future, "overlap": "sometimes"},
        {"name": "b", "message": "m", "at": future, "catch_up": "never"},
        {"name": "b b", "message": "m", "at": future},
        {"name": "b", "message": "", "at": future},
        {"name": "b", "message": "m", "at": future, "output_schema": {"type": 5}},
        {"name": "b", "message": "m", "at": future, "webhook": {"url": "ftp://example.com"}},
    ]
    for body in bad:
        reply = await api.call("POST", "/schedules", body)
        assert reply.status_code == 422, (body, reply.text)
        assert reply.json()["error"] == "INVALID_REQUEST", reply.text
    reply = await api.call(
        "POST", "/schedules", {"name": "b", "message": "m", "at": future, "agent": "nobody"}
    )
    assert reply.status_code == 404 and reply.json()["error"] == "AGENT_NOT_FOUND"

    created = await api.create(name="once", at=future, message="m", timezone="Europe/Paris")
    assert created["status"] == "active" and when(created["next_due_at"]) == when(future)
    naive = await api.create(
        name="local", at="2099-07-01T09:00:00", timezone="Europe/Paris", message="m"
    )
    assert when(naive["at"]) == utc(2099, 7, 1, 7)
    reply = await api.call("POST", "/schedules", {"name": "once", "at": future, "message": "m"})
    assert reply.status_code == 409 and reply.json()["error"] == "SCHEDULE_EXISTS"
    # Another tenant sees none of it, and may use the name.
    for method, path in [
        ("GET", "/schedules/once"),
        ("POST", "/schedules/once/pause"),
        ("DELETE", "/schedules/once"),
        ("GET", "/schedules/once/runs"),
    ]:
        reply = await other.call(method, path)
        assert reply.status_code == 404 and reply.json()["error"] == "SCHEDULE_NOT_FOUND"
    assert (await other.call("GET", "/schedules")).json() == {"schedules": []}
    await other.create(name="once", at=future, message="m")

    paused = (await api.call("POST", "/schedules/once/pause")).json()
    assert paused["status"] == "paused"
    resumed = (await api.call("POST", "/schedules/once/resume")).json()
    assert resumed["status"] == "active" and when(resumed["next_due_at"]) == when(future)
    listed = (await api.call("GET", "/schedules")).json()["schedules"]
    assert [s["name"] for s in listed] == ["local", "once"]
    assert (await api.call("DELETE", "/schedules/once")).status_code == 204
    assert (await api.call("GET", "/schedules/once")).status_code == 404
    assert (await api.runs("local")) == []


async def test_a_run_is_a_turn_with_the_schedules_output_schema(
    procs: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    sessions: Sessions,
) -> None:
    (base,) = start_gateways(procs, 1, datetime.now(UTC))
    api = Api(client, base, api_keys["main"])
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    await api.create(name="shaped", interval_seconds=1, message="m", output_schema=schema)
    runs: list[dict[str, Any]] = []

    async def started() -> bool:
        runs[:] = [r for r in await api.runs("shaped") if r["status"] == "started"]
        return bool(runs)

    await until(started, "a run")
    await api.call("DELETE", "/schedules/shaped")
    async with sessions() as session:
        turn = await session.get(Turn, runs[0]["turn_id"])
    assert turn is not None and turn.output_schema == schema


def slow(seconds: float) -> str:
    """A scripted answer streaming for about ``seconds``."""
    deltas = int(seconds * 20)
    return "/script " + json.dumps({"text": "w ", "deltas": deltas, "delay_ms": 50})


async def test_overlap_on_the_schedules_own_task(
    procs: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    sessions: Sessions,
) -> None:
    procs.start_worker()
    (base,) = start_gateways(procs, 1, datetime.now(UTC))
    api = Api(client, base, api_keys["main"])
    # Each turn streams for ~6 s while the schedule is due every second.
    await api.create(
        name="skip", interval_seconds=1, task_id="skip-task", message=slow(6), overlap="skip"
    )
    await api.create(
        name="cancel",
        interval_seconds=3,
        task_id="cancel-task",
        message=slow(60),
        overlap="cancel_previous",
    )
    runs: dict[str, list[dict[str, Any]]] = {}

    async def two_started(name: str) -> bool:
        runs[name] = await api.runs(name)
        return sum(r["status"] == "started" for r in runs[name]) >= 2

    await until(lambda: two_started("skip"), "skip: a second run after the first ended", 60)
    await until(lambda: two_started("cancel"), "cancel_previous: a second run", 60)
    for name in ("skip", "cancel"):
        await api.call("POST", f"/schedules/{name}/pause")
        runs[name] = await api.runs(name)

    skip = runs["skip"]
    first, then = skip[0], next(r for r in skip[1:] if r["status"] == "started")
    skipped = skip[1 : skip.index(then)]
    assert skipped, skip
    for run in skipped:
        assert run["status"] == "skipped", skip
        assert run["reason"] == f"overlap skip: turn {first['turn_id']} is still active"
    assert {r["task_id"] for r in skip if r["status"] == "started"} == {"skip-task"}

    cancel = [r for r in runs["cancel"] if r["status"] == "started"]
    async with sessions() as session:
        cancelled = await session.get(Turn, cancel[0]["turn_id"])
    assert cancelled is not None and cancelled.stop_reason == "cancelled", cancelled
    assert {r["task_id"] for r in cancel} == {"cancel-task"}
    # Both runs' turns are of one task, one after the other: the second waited.
    assert await turns_of_runs(sessions, ["cancel-task"]) == {"cancel-task": len(cancel)}
