"""The crash matrix's cells ``test_tool_effects.py`` leaves out (#26): the loop-worker
killed before a call is queued, Redis restarted empty while a call runs (per class),
and the loop-worker killed mid-run for a read-only tool.

The tools are an Asset Directory server's, built with the official SDK (``MCPServer``)
and running in this process, on the host: each execution appends a line (tool, token,
idempotency key) to a counter file outside every workspace, so no sandbox, runner or
workspace the crash touches can lose or fake a count. The sandbox offers a tool no
writable path outside its workspace (its only extra mounts are read-only), and an MCP
server is how the engine calls code that lives elsewhere. A call whose token the test
holds waits, after counting itself, until the test lets it go: the crash lands while
the call runs, whatever the machine's speed. What the model sees is read back through
the HTTP replay API: exactly one ``tool_result`` per call id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest
from holdfast_shared.db.models import EventRecord, ToolResultRecord
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing import RedisServer
from tests.conftest import engine_env
from tests.e2e.test_tool_effects import _ended
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.oauth_stand_in import _free_port, _Thread
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute
from tests.taskids import engine_task_id
from tests.waiting import Events, logged, until, until_logged

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

META = "io.holdfast/idempotency-key"
# The server's tools by the class their annotations give.
TOOLS = {"read_only": "look", "idempotent": "put", "effectful": "pay"}


class CountingServer:
    """An MCPServer whose tools count each execution in ``counter`` (on the host)
    and then wait while their token is held."""

    def __init__(self, counter: Path) -> None:
        self.counter = counter
        # The calls held (by token): each waits until its event is set.
        self._held: dict[str, threading.Event] = {}
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        mcp = MCPServer("counting")

        async def counted(tool: str, token: str, ctx: Context) -> str:
            key = (ctx.request_context.meta or {}).get(META)
            with self.counter.open("a") as out:
                out.write(f"{tool} {token} {key}\n")
            gate = self._held.get(token)
            if gate is not None:  # the test lets it go once its crash is done
                await anyio.to_thread.run_sync(gate.wait)
            return f"{tool} {token} done"

        @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
        async def look(token: str, ctx: Context) -> str:
            """Read something."""
            return await counted("look", token, ctx)

        @mcp.tool(annotations=ToolAnnotations(idempotent_hint=True))
        async def put(token: str, ctx: Context) -> str:
            """Set something to a value."""
            return await counted("put", token, ctx)

        @mcp.tool()
        async def pay(token: str, ctx: Context) -> str:
            """Pay an amount."""
            return await counted("pay", token, ctx)

        self._thread = _Thread(mcp.streamable_http_app(), self.port)

    def hold(self, token: str) -> None:
        self._held[token] = threading.Event()

    def release(self, token: str) -> None:
        self._held[token].set()

    def runs(self, token: str) -> list[str]:
        """The idempotency key of each execution of the call holding ``token``."""
        if not self.counter.exists():
            return []
        lines = [line.split(" ") for line in self.counter.read_text().splitlines()]
        return [key for _tool, held, key in lines if held == token]

    def __enter__(self) -> CountingServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for gate in self._held.values():
            gate.set()
        self._thread.stop()


@pytest.fixture(scope="module")
def volatile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The engine's own Redis, without persistence: killed and started, it is empty."""
    server = RedisServer(tmp_path_factory.mktemp("matrix-redis"), durable=False)
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def counting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CountingServer]:
    with CountingServer(tmp_path_factory.mktemp("matrix-counter") / "effects.log") as server:
        yield server


@pytest.fixture(scope="module")
def cluster(
    volatile: RedisServer,
    database_url: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """A gateway, a loop-worker and a tool-runner (a killed worker is replaced)."""
    env = engine_env(
        volatile.url,
        database_url,
        "matrix:",
        HOLDFAST_LEASE_SECONDS="2",
        HOLDFAST_TOOL_CLAIM_IDLE_SECONDS="3",
        HOLDFAST_WORKSPACE_ROOT=str(tmp_path_factory.mktemp("matrix-workspaces")),
        # A reply lost with the Redis that carried it is looked for in the
        # call's row after this (plus the worker's grace), not after a minute;
        # a held call is let go long before it.
        HOLDFAST_TOOL_TIMEOUT_SECONDS="15",
    )
    with running_engine(
        env, workers=1, runners=1, directory=tmp_path_factory.mktemp("matrix")
    ) as procs:
        yield procs


@dataclass(frozen=True)
class Setup:
    agent: str
    server: str


@pytest.fixture(scope="module")
def setup(cluster: EngineProcesses, counting: CountingServer, api_keys: dict[str, str]) -> Setup:
    """The counting server in the Asset Directory and an agent allowed its tools."""
    headers = {"X-Engine-Key": api_keys["main"]}
    server = f"counting-{secrets.token_hex(3)}"
    registered = httpx.post(
        f"{cluster.url}/assets/servers",
        json={"name": server, "transport": "streamable-http", "url": counting.url},
        headers=headers,
        timeout=60,
    )
    assert registered.status_code == 201, registered.text
    shown = httpx.get(f"{cluster.url}/assets/servers/{server}", headers=headers).json()
    assert {t["name"]: t["effect"] for t in shown["tools"]} == {
        tool: effect for effect, tool in TOOLS.items()
    }
    agent = f"matrix-{secrets.token_hex(3)}"
    created = httpx.post(
        f"{cluster.url}/agents",
        json={
            "name": agent,
            "description": "calls the counting server",
            "system_prompt": "You call tools.",
            "servers": [server],
            "permissions": {f"{server}__*": "allow"},
        },
        headers=headers,
    )
    assert created.status_code == 201, created.text
    return Setup(agent, server)


def script(server: str, *calls: tuple[str, str]) -> str:
    """One model reply calling each (effect class, token) in order."""
    return "/script " + json.dumps(
        {
            "tool_calls": [
                {"name": f"{server}__{TOOLS[effect]}", "input": {"token": token}}
                for effect, token in calls
            ]
        }
    )


def results_by_call(events: Events) -> dict[str, int]:
    counts: dict[str, int] = {}
    for event in events:
        if event["type"] == "tool_result":
            counts[event["tool_call_id"]] = counts.get(event["tool_call_id"], 0) + 1
    return counts


def token() -> str:
    return secrets.token_hex(4)


async def _row(
    sessions: async_sessionmaker[AsyncSession], task: str, call_id: str
) -> ToolResultRecord | None:
    async with sessions() as session:
        return await session.scalar(
            select(ToolResultRecord).where(
                ToolResultRecord.task_id == task, ToolResultRecord.tool_call_id == call_id
            )
        )


async def _started(
    client: httpx.AsyncClient,
    cluster: EngineProcesses,
    key: str,
    task_id: str,
    counting: CountingServer,
    held: str,
    calls: int = 1,
) -> Events:
    """Waits for the turn's ``calls`` tool_call events and for the held call to have
    counted itself (it is running now, and stays so until let go)."""
    events = await until_logged(
        client,
        cluster.url,
        key,
        task_id,
        lambda events: [e["type"] for e in events].count("tool_call") >= calls,
        "no tool_call",
    )

    async def running() -> bool:
        return bool(counting.runs(held))

    await until(running, "the tool never started")
    return events


async def _ended_log(
    client: httpx.AsyncClient, cluster: EngineProcesses, key: str, task_id: str
) -> Events:
    return await until_logged(
        client, cluster.url, key, task_id, _ended, "the turn never ended", within=120
    )


async def _stop(live: asyncio.Task[Any]) -> None:
    live.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await live


@pytest.mark.parametrize("effect", list(TOOLS))
async def test_a_call_not_queued_when_its_worker_dies_is_sent_once_by_the_next(
    cluster: EngineProcesses,
    setup: Setup,
    counting: CountingServer,
    api_keys: dict[str, str],
    sessions: async_sessionmaker[AsyncSession],
    effect: str,
) -> None:
    """The model asked for two calls; the worker dies while the first runs, so the
    second is logged (``tool_call``) but never queued: no claim of it exists. The
    next worker reads the first one's result back and sends the second for the
    first time: each ran once."""
    key = api_keys["main"]
    task_id = f"matrix-{secrets.token_hex(3)}"
    first, second = token(), token()
    counting.hold(first)
    body = {
        "message": script(setup.server, ("idempotent", first), (effect, second)),
        "task_id": task_id,
        "agent": setup.agent,
    }
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(execute(client, cluster.url, key, body))
        try:
            events = await _started(client, cluster, key, task_id, counting, first, calls=2)
            cluster.kill(cluster.workers[0])
            task = await engine_task_id(sessions, task_id)
            later = [e for e in events if e["type"] == "tool_call"][1]["tool_call_id"]
            assert await _row(sessions, task, later) is None, "the second call was never claimed"
            assert counting.runs(second) == []
            counting.release(first)
            cluster.start_worker()
            log = await _ended_log(client, cluster, key, task_id)
        finally:
            await _stop(live)
    calls = [e["tool_call_id"] for e in log if e["type"] == "tool_call"]
    assert results_by_call(log) == dict.fromkeys(calls, 1), "one result per call"
    assert len(counting.runs(first)) == 1 and len(counting.runs(second)) == 1
    assert "tool_outcome_unknown" not in [e["type"] for e in log]
    results = [e for e in log if e["type"] == "tool_result"]
    assert results[1]["output"] and second in json.dumps(results[1]["output"])
    assert log[-1]["phase"] == "completed"


async def test_a_read_only_call_whose_worker_dies_mid_run_runs_once(
    cluster: EngineProcesses,
    setup: Setup,
    counting: CountingServer,
    api_keys: dict[str, str],
) -> None:
    """The call finishes and is stored while its worker is dead; the next worker
    reads the result back instead of running it again."""
    key = api_keys["main"]
    task_id = f"matrix-{secrets.token_hex(3)}"
    held = token()
    counting.hold(held)
    body = {
        "message": script(setup.server, ("read_only", held)),
        "task_id": task_id,
        "agent": setup.agent,
    }
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(execute(client, cluster.url, key, body))
        try:
            await _started(client, cluster, key, task_id, counting, held)
            cluster.kill(cluster.workers[0])
            counting.release(held)
            cluster.start_worker()
            log = await _ended_log(client, cluster, key, task_id)
        finally:
            await _stop(live)
    call = next(e["tool_call_id"] for e in log if e["type"] == "tool_call")
    assert results_by_call(log) == {call: 1}
    assert len(counting.runs(held)) == 1, "ran once"
    assert "tool_outcome_unknown" not in [e["type"] for e in log]
    assert "turn_resumed" in [e["type"] for e in log]
    assert log[-1]["phase"] == "completed"


async def _archived(sessions: async_sessionmaker[AsyncSession], task: str, kind: str) -> bool:
    async with sessions() as session:
        found = await session.scalar(
            select(EventRecord.seq).where(EventRecord.task_id == task, EventRecord.type == kind)
        )
    return found is not None


# Last in the module: each restarts the engine's Redis empty.
@pytest.mark.parametrize("effect", list(TOOLS))
@pytest.mark.parametrize("finished", ["at_once", "after_the_resume"])
async def test_redis_restarted_empty_mid_call_never_runs_it_twice_unasked(
    cluster: EngineProcesses,
    setup: Setup,
    counting: CountingServer,
    volatile: RedisServer,
    api_keys: dict[str, str],
    sessions: async_sessionmaker[AsyncSession],
    effect: str,
    finished: str,
) -> None:
    """Redis loses everything (streams, groups, the runner's liveness key, the
    worker's inbox) while the call runs; its runner lives and finishes it. No
    class runs it twice: the resumed turn reads the stored result back, and an
    effectful call ends in its own result or in ``tool_outcome_unknown`` a person
    settles (here ``failed``), never in a silent second run.

    ``after_the_resume``: the call is let go only once ``turn_resumed`` is
    logged; it overruns its timeout meanwhile (docs/reliability.md)."""
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    task_id = f"matrix-{secrets.token_hex(3)}"
    held = token()
    counting.hold(held)
    body = {
        "message": script(setup.server, (effect, held)),
        "task_id": task_id,
        "agent": setup.agent,
    }
    async with httpx.AsyncClient(timeout=60) as client:
        live = asyncio.create_task(execute(client, cluster.url, key, body))
        try:
            await _started(client, cluster, key, task_id, counting, held)
            task = await engine_task_id(sessions, task_id)
            # The call is logged durably before the loss, so the log read
            # back after it still names the call its result must answer.
            await until(lambda: _archived(sessions, task, "tool_call"), "tool_call not archived")
            volatile.kill()
            volatile.start()  # empty
            if finished == "after_the_resume":
                await until_logged(
                    client,
                    cluster.url,
                    key,
                    task_id,
                    logged("turn_resumed"),
                    "the turn was never resumed",
                    within=120,
                )
            counting.release(held)
            settled = False

            def asked_or_ended(events: Events) -> bool:
                return _ended(events) or logged("hitl_request")(events)

            log = await until_logged(
                client,
                cluster.url,
                key,
                task_id,
                asked_or_ended,
                "neither asked nor ended",
                within=120,
            )
            if not _ended(log):
                pending = (await client.get(f"{cluster.url}/hitl/pending", headers=headers)).json()
                request = next(p for p in pending["pending"] if p["task_id"] == task_id)
                assert request["kind"] == "outcome_unknown"
                answered = await client.post(
                    f"{cluster.url}/hitl/respond",
                    json={
                        "task_id": task_id,
                        "request_id": request["request_id"],
                        "answer": "failed",
                    },
                    headers=headers,
                )
                assert answered.status_code == 200, answered.text
                settled = True
                log = await _ended_log(client, cluster, key, task_id)
        finally:
            await _stop(live)
    call = next(e["tool_call_id"] for e in log if e["type"] == "tool_call")
    assert results_by_call(log) == {call: 1}, "the model sees one result"
    runs = counting.runs(held)
    unknown = [e for e in log if e["type"] == "tool_outcome_unknown"]
    assert runs and set(runs) == {runs[0]} and runs[0] != "None", "every run with the one key"
    if finished == "at_once" or effect == "effectful":
        assert len(runs) == 1, "run once: the runner lived"
    else:
        # The worker that ran the turn keeps it until its next append (fenced:
        # the epoch went with Redis), so the held call overruns its 15 s
        # timeout: run again with its key up to HOLDFAST_TOOL_RETRIES (2).
        # One key: a tool that dedupes by it has one effect.
        assert len(runs) <= 3, runs
    if effect == "effectful" or finished == "after_the_resume":
        # The second: every run overran its timeout, so once the retries ran
        # out a person is asked (docs/reliability.md says what this measures).
        assert settled == bool(unknown), "asked exactly when the outcome was unknown"
    else:
        assert not unknown and not settled
    assert log[-1]["phase"] == "completed"
