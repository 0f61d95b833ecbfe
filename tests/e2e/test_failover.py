"""Failover in seconds: a killed loop-worker's turn, and a killed tool-runner's call in
flight, are taken over once the process's liveness key lapses (HOLDFAST_LIVENESS_SECONDS,
2 s here as by default) — not when the 10 s lease or the 30 s claim idle time run out.
A worker stopped cleanly (SIGTERM) hands its turn back at once."""

from __future__ import annotations

import asyncio
import inspect
import json
import secrets
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import ToolResultRecord, Turn
from httpx_sse import aconnect_sse
from sqlalchemy import select

from holdfast.testing import Process
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# The liveness TTL (2 s) + a scan (0.5 s) + resuming, with room for a loaded machine;
# the lease (10 s) and the tool claim idle time (30 s) are far beyond it.
TAKEOVER_WITHIN_S = 6.0
SLOW_TURN = "/script " + json.dumps({"text": "x", "deltas": 60, "delay_ms": 100})


@pytest.fixture(scope="module")
def failover_engine(
    redis_url: str, database_url: str, redis_prefix: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcesses]:
    prefix = f"{redis_prefix}failover-{secrets.token_hex(3)}:"
    env = engine_env(
        redis_url,
        database_url,
        prefix,
        HOLDFAST_TOOL_PERMISSIONS=json.dumps({"*": {"bash": "allow"}}),
        HOLDFAST_DRAIN_SECONDS="0.2",
        HOLDFAST_WORKSPACE_ROOT=str(tmp_path_factory.mktemp("failover-workspaces")),
    )
    directory = tmp_path_factory.mktemp("failover")
    # Three workers: each test takes one away (no replacement to wait for).
    with running_engine(env, workers=3, runners=2, directory=directory) as procs:
        yield procs


@dataclass
class Watched:
    """A turn's stream, read in the background, each event with when it arrived."""

    turn_id: str = ""
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def first(self, event_type: str, after: float = 0.0) -> float | None:
        return next((t for t, e in self.events if e["type"] == event_type and t >= after), None)

    @property
    def last(self) -> dict[str, Any]:
        return self.events[-1][1]


async def watch(client: httpx.AsyncClient, base: str, key: str, message: str) -> Watched:
    watched = Watched()

    async def read() -> None:
        async with aconnect_sse(
            client,
            "POST",
            f"{base}/execute",
            headers={"X-Engine-Key": key},
            json={"message": message},
        ) as source:
            assert source.response.status_code == 200
            watched.turn_id = source.response.headers["X-Turn-Id"]
            async for sse in source.aiter_sse():
                if sse.event != "heartbeat":
                    watched.events.append((time.monotonic(), json.loads(sse.data)))
                    watched.started.set()

    watched.task = asyncio.create_task(read())
    await asyncio.wait_for(watched.started.wait(), 20)
    return watched


async def ended(watched: Watched) -> None:
    assert watched.task is not None
    await asyncio.wait_for(watched.task, 60)


async def wait_for(
    what: str, check: Callable[[], Awaitable[Any] | Any], within: float = 20.0
) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = check()
        if inspect.isawaitable(found):
            found = await found
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not within {within:g} s")


def process_named(procs: list[Process], ident: str) -> Process:
    return next(p for p in procs if p.ident == ident)


async def lease_owner(sessions: Any, turn_id: str) -> str | None:
    async with sessions() as session:
        owner = await session.scalar(select(Turn.lease_owner).where(Turn.id == turn_id))
    return None if owner is None else str(owner)


def assert_whole(watched: Watched) -> None:
    seqs = [e["seq"] for _t, e in watched.events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "a gap or a repeat in the stream"
    assert watched.last["type"] == "thread_lifecycle" and watched.last["phase"] == "completed"


async def _kill_the_turns_worker(
    procs: EngineProcesses, key: str, sessions: Any, sig: signal.Signals
) -> tuple[Watched, float, str]:
    async with httpx.AsyncClient(timeout=60) as client:
        watched = await watch(client, procs.url, key, SLOW_TURN)
        await wait_for(
            "text streaming",
            lambda: sum(e["type"] == "text_delta" for _t, e in watched.events) >= 3,
        )
        owner = await wait_for("a lease owner", lambda: lease_owner(sessions, watched.turn_id))
        victim = process_named(procs.workers, owner)
        killed_at = time.monotonic()
        await asyncio.to_thread(procs.kill, victim, sig)
        await ended(watched)
    resumed = watched.first("turn_resumed", after=killed_at)
    assert resumed is not None, [e["type"] for _t, e in watched.events]
    return watched, resumed - killed_at, owner


async def test_a_killed_workers_turn_continues_within_seconds(
    failover_engine: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    procs = failover_engine
    watched, gap, dead = await _kill_the_turns_worker(
        procs, api_keys["main"], sessions, signal.SIGKILL
    )
    assert gap < TAKEOVER_WITHIN_S, f"took {gap:.1f} s"
    resumed = next(e for _t, e in watched.events if e["type"] == "turn_resumed")
    assert resumed["reason"] == "worker_lost"
    assert_whole(watched)
    assert watched.last["stop_reason"] == "end_turn"

    async def completed() -> bool:
        # Recorded just after the terminal event is logged (which the client saw).
        async with sessions() as session:
            status = await session.scalar(select(Turn.status).where(Turn.id == watched.turn_id))
        return bool(status == "completed")

    await wait_for("the turn recorded as completed", completed)
    # The dead worker's lease was ended, not waited out: its name is nowhere left.
    async with sessions() as session:
        held = await session.scalar(select(Turn.id).where(Turn.lease_owner == dead).limit(1))
    assert held is None


async def test_a_stopped_worker_hands_its_turn_back_at_once(
    failover_engine: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    procs = failover_engine
    watched, gap, _owner = await _kill_the_turns_worker(
        procs, api_keys["main"], sessions, signal.SIGTERM
    )
    # HOLDFAST_DRAIN_SECONDS is 0.2: then the turn is handed back and queued again.
    assert gap < 3.0, f"took {gap:.1f} s"
    resumed = next(e for _t, e in watched.events if e["type"] == "turn_resumed")
    assert resumed["reason"] == "resumed"
    assert_whole(watched)


async def test_a_killed_runners_call_in_flight_is_answered_within_seconds(
    failover_engine: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    procs = failover_engine
    message = "/script " + json.dumps(
        {"text": "", "tool_calls": [{"name": "bash", "input": {"command": "sleep 25"}}]}
    )
    async with httpx.AsyncClient(timeout=60) as client:
        watched = await watch(client, procs.url, api_keys["main"], message)
        await wait_for("the tool call", lambda: watched.first("tool_call"))

        async def running_on() -> str | None:
            async with sessions() as session:
                runner = await session.scalar(
                    select(ToolResultRecord.runner).where(
                        ToolResultRecord.turn_id == watched.turn_id,
                        ToolResultRecord.status == "running",
                    )
                )
            return None if runner is None else str(runner)

        runner = await wait_for("the call running", running_on)
        killed_at = time.monotonic()
        await asyncio.to_thread(procs.kill, process_named(procs.runners, runner))
        # bash is effectful: its outcome is unknown, and a person is asked (#26).
        await wait_for(
            "the outcome_unknown request",
            lambda: watched.first("hitl_request", after=killed_at),
            within=2 * TAKEOVER_WITHIN_S,
        )
        request = next(e for _t, e in watched.events if e["type"] == "hitl_request")
        headers = {"X-Engine-Key": api_keys["main"]}
        pending = (await client.get(f"{procs.url}/hitl/pending", headers=headers)).json()
        task_name = next(
            p["task_id"] for p in pending["pending"] if p["request_id"] == request["request_id"]
        )
        settled = await client.post(
            f"{procs.url}/hitl/respond",
            json={"task_id": task_name, "request_id": request["request_id"], "answer": "failed"},
            headers=headers,
        )
        assert settled.status_code == 200, settled.text
        await ended(watched)
    answered = watched.first("tool_outcome_unknown", after=killed_at)
    assert answered is not None
    assert answered - killed_at < TAKEOVER_WITHIN_S, f"took {answered - killed_at:.1f} s"
    assert request["kind"] == "outcome_unknown"
    result = next(e for _t, e in watched.events if e["type"] == "tool_result")
    assert "did not take effect" in result["error"]
    assert watched.last["type"] == "thread_lifecycle"
