"""Prometheus metrics and JSON logs of real gateway, worker, runner and learner processes."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from holdfast_gateway.queuegauges import QueueGauges
from holdfast_shared.keys import Keys
from holdfast_shared.observability import metrics
from holdfast_shared.observability.process import metrics_ports
from holdfast_shared.settings import Settings
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from redis.asyncio import Redis
from rich.console import Console
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.supervisor import _banner, _Child
from holdfast.testing import Process
from holdfast.testing.processes import Kind
from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, free_port, running_engine
from tests.sse_client import execute
from tests.taskids import engine_task_id

# Generous: the module's engine starts four processes, on a machine that may be busy.
pytestmark = pytest.mark.timeout(240)
STARTUP_SECONDS = 180

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def moved(before: Samples, after: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    """The label sets of ``name`` whose value changed, with the change."""
    keys = {k for k in (*before, *after) if k[0] == name}
    changes = {k[1]: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
    return {labels: delta for labels, delta in changes.items() if delta}


class Engine:
    def __init__(self, procs: EngineProcesses, ports: dict[Kind, int]) -> None:
        self.procs = procs
        self.ports = ports

    async def scrape(self, client: httpx.AsyncClient, which: str) -> Samples:
        url = (
            f"{self.procs.url}/metrics"
            if which == "gateway"
            else f"http://127.0.0.1:{self.ports[which]}/metrics"  # type: ignore[index]
        )
        response = await client.get(url)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain")
        return parse(response.text)

    def log_lines(self, process: Process) -> list[dict[str, Any]]:
        lines = Path(process.log).read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]


@pytest.fixture(scope="module")
def observed(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Engine]:
    """A gateway, loop-worker, tool-runner and learner, each worker with its own
    metrics port, all logging JSON."""
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}metrics:",
        HOLDFAST_WORKSPACE_ROOT=str(tmp_path_factory.mktemp("metrics-workspaces")),
        HOLDFAST_LOG_FORMAT="json",
        HOLDFAST_LOG_LEVEL="INFO",
        HOLDFAST_EMBEDDER="none",
        HOLDFAST_LEARNING_BATCH_WINDOW_SECONDS="0.1",
    )
    kinds: tuple[Kind, ...] = ("loop-worker", "tool-runner", "learning")
    ports = {kind: free_port() for kind in kinds}
    with running_engine(
        env, workers=0, gateways=0, directory=tmp_path_factory.mktemp("metrics")
    ) as procs:
        procs.start("gateway", wait=False)
        for kind, port in ports.items():
            procs.start(kind, env={"HOLDFAST_METRICS_PORT": str(port)}, wait=False)
        procs.wait_ready(*procs.processes, within=STARTUP_SECONDS)
        yield Engine(procs, ports)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as http:
        yield http


def tool_script(*calls: dict[str, Any], text: str = "") -> str:
    return "/script " + json.dumps({"text": text, "tool_calls": list(calls)})


async def test_a_turn_moves_the_counters_of_each_process(
    observed: Engine,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    before = {p: await observed.scrape(client, p) for p in ("gateway", *observed.ports)}
    name = f"metrics-{secrets.token_hex(4)}"
    got = await execute(
        client,
        observed.procs.url,
        api_keys["main"],
        {"message": tool_script({"name": "list_dir", "input": {}}, text="done"), "task_id": name},
    )
    assert got.status == 200 and got.events[-1]["phase"] == "completed", got.types
    assert "tool_result" in got.types
    worker_before = before["loop-worker"]
    for _ in range(100):  # the job's run ends just after the turn's terminal event
        worker = await observed.scrape(client, "loop-worker")
        if moved(worker_before, worker, "holdfast_turn_runs_total"):
            break
        await asyncio.sleep(0.05)
    started = moved(worker_before, worker, "holdfast_turns_started_total")
    assert list(started.values()) == [1.0], started
    (labels,) = started
    agent, model = dict(labels)["agent"], dict(labels)["model"]
    assert agent and agent != metrics.OTHER  # the resolved agent's name
    assert model.startswith("scripted:"), model
    assert moved(worker_before, worker, "holdfast_turns_completed_total") == {labels: 1.0}
    assert not moved(worker_before, worker, "holdfast_turns_errored_total")
    # Its run; a resume job queued later for the ended turn would run as "skipped".
    runs = moved(worker_before, worker, "holdfast_turn_runs_total")
    assert runs[frozenset({("outcome", "completed")})] == 1.0, runs
    # Two model calls: the one asking for the tool, the one answering after it.
    ttft = moved(worker_before, worker, "holdfast_model_time_to_first_token_seconds_count")
    assert ttft == {frozenset({("model", model)}): 2.0}
    tokens = moved(worker_before, worker, "holdfast_model_tokens_total")
    assert tokens[frozenset({("model", model), ("kind", "output")})] > 0
    assert tokens[frozenset({("model", model), ("kind", "input")})] > 0
    # The worker appends every event of the turn but the gateway's "started".
    appended = moved(worker_before, worker, "holdfast_events_appended_total")
    assert appended[frozenset({("type", "tool_call")})] == 1.0
    assert appended[frozenset({("type", "tool_result")})] == 1.0
    assert appended[frozenset({("type", "thread_lifecycle")})] == 1.0  # "completed"
    assert sum(appended.values()) == len(got.events) - 1

    runner = await observed.scrape(client, "tool-runner")
    assert moved(before["tool-runner"], runner, "holdfast_tool_seconds_count") == {
        frozenset({("tool", "list_dir"), ("outcome", "ok")}): 1.0
    }

    gateway = await observed.scrape(client, "gateway")
    assert moved(before["gateway"], gateway, "holdfast_events_appended_total") == {
        frozenset({("type", "thread_lifecycle")}): 1.0  # "started"
    }
    # The queues, read by the gateway on scrape (at most every 5 s: their values
    # are test_queue_gauges_report_the_oldest_pending_entry's).
    for stream, group in (("turns", "loop-workers"), ("tools", "tool-runners")):
        assert ("holdfast_stream_length", frozenset({("stream", stream)})) in gateway
        labels = frozenset({("stream", stream), ("group", group)})
        for series in ("pending", "lag", "oldest_pending_seconds"):
            assert (f"holdfast_stream_{series}", labels) in gateway
    assert ("holdfast_hitl_waiting_turns", frozenset()) in gateway

    # The learner learns the turn's trajectory and says how long after its end.
    for _ in range(100):
        learner = await observed.scrape(client, "learning")
        learned = moved(before["learning"], learner, "holdfast_trajectories_total")
        if learned:
            break
        await asyncio.sleep(0.1)
    # At least ours (the sweep of this learner may take another engine's too).
    assert set(learned) == {frozenset({("outcome", "learned")})}
    assert learned[frozenset({("outcome", "learned")})] >= 1
    lag = moved(before["learning"], learner, "holdfast_learning_lag_seconds_count")
    assert lag[frozenset()] >= 1

    # JSON logs: the worker's and the runner's lines of this turn carry its ids.
    task_id = await engine_task_id(sessions, name)
    turn_id = got.events[0]["turn_id"]
    for process in (observed.procs.workers[0], observed.procs.runners[0]):
        lines = observed.log_lines(process)
        assert lines, observed.procs.log_tail(process)
        for line in lines:
            assert {"time", "level", "logger", "message", "service"} <= set(line), line
        ours = [line for line in lines if line.get("turn_id") == turn_id]
        assert ours, lines[-5:]
        assert all(line["task_id"] == task_id for line in ours)
    closing = [
        line
        for line in observed.log_lines(observed.procs.workers[0])
        if line.get("turn_id") == turn_id and line["message"].endswith(": completed")
    ]
    assert len(closing) == 1, closing


async def test_sse_connections_are_counted_while_open(
    observed: Engine, api_keys: dict[str, str], client: httpx.AsyncClient
) -> None:
    slow = "/script " + json.dumps({"text": "a b c d e f g h", "delay_ms": 150})
    turn = asyncio.create_task(
        execute(client, observed.procs.url, api_keys["main"], {"message": slow})
    )
    seen = 0.0
    for _ in range(40):
        seen = value(await observed.scrape(client, "gateway"), "holdfast_sse_connections")
        if seen >= 1 or turn.done():
            break
        await asyncio.sleep(0.05)
    got = await turn
    assert got.status == 200
    assert seen >= 1
    after = value(await observed.scrape(client, "gateway"), "holdfast_sse_connections")
    assert after == seen - 1


async def test_queue_gauges_report_the_oldest_pending_entry(
    redis: Redis, sessions: async_sessionmaker[AsyncSession], redis_prefix: str
) -> None:
    keys = Keys(f"{redis_prefix}queues-{secrets.token_hex(3)}:")
    await redis.xgroup_create(keys.tools, "tool-runners", id="0", mkstream=True)
    await redis.xadd(keys.tools, {"job": "{}"})
    await redis.xadd(keys.tools, {"job": "{}"})
    await redis.xreadgroup("tool-runners", "c1", {keys.tools: ">"}, count=1)
    now = [0.0]
    gauges = QueueGauges(redis, keys, sessions, min_interval=5.0, clock=lambda: now[0])
    await asyncio.sleep(0.2)
    await gauges.refresh()
    labels = ("tools", "tool-runners")
    assert metrics.STREAM_LENGTH.labels("tools")._value.get() == 2
    assert metrics.STREAM_PENDING.labels(*labels)._value.get() == 1
    assert metrics.STREAM_LAG.labels(*labels)._value.get() == 1
    age = metrics.STREAM_OLDEST_PENDING.labels(*labels)._value.get()
    assert 0.2 <= age < 30
    # A stream that does not exist (no turns yet) reads as empty, not as an error.
    assert metrics.STREAM_LENGTH.labels("turns")._value.get() == 0
    # Within min_interval a scrape costs nothing: the gauges stay as they were.
    await redis.xadd(keys.tools, {"job": "{}"})
    now[0] = 1.0
    await gauges.refresh()
    assert metrics.STREAM_LENGTH.labels("tools")._value.get() == 2
    now[0] = 6.0
    await gauges.refresh()
    assert metrics.STREAM_LENGTH.labels("tools")._value.get() == 3
    await redis.delete(keys.tools)


def test_label_values_are_bounded() -> None:
    cap = metrics._LabelCap(limit=2)
    assert [cap(v) for v in ("a", "b", "c", "a", None)] == ["a", "b", "other", "a", "other"]
    assert metrics.tool_label("github__create_issue", server="github") == "mcp"
    assert metrics.tool_label("bash", server=None) == "bash"


def test_metrics_ports_and_serving() -> None:
    base = Settings(port=9000)
    assert metrics_ports(base, ["tool-runner", "learning", "loop-worker"]) == {
        "tool-runner": 9001,
        "learning": 9002,
        "loop-worker": 9003,
    }
    assert metrics_ports(Settings(metrics_port=7000), ["a", "b"]) == {"a": 7000, "b": 7001}
    assert metrics_ports(Settings(metrics_port=0), ["a"]) == {}
    assert metrics.serve_metrics("127.0.0.1", 0) is None
    assert metrics.serve_metrics("127.0.0.1", None) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        # A port in use: the process runs on without metrics instead of failing.
        assert metrics.serve_metrics("127.0.0.1", taken.getsockname()[1]) is None


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("HOLDFAST_METRICS_PORT", "70000"),
        ("HOLDFAST_METRICS_PORT", "x"),
        ("HOLDFAST_LOG_FORMAT", "xml"),
    ],
)
def test_bad_settings_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as caught:
        Settings()
    assert variable.removeprefix("HOLDFAST_").lower() in str(caught.value)


def test_holdfast_up_prints_where_the_metrics_are(tmp_path: Path) -> None:
    settings = Settings(port=8100)
    children = [
        _Child("tool-runner", "tool-runner", "magenta"),
        _Child("gateway", "gateway", "cyan"),
        _Child("loop-worker-1", "loop-worker", "green"),
        _Child("loop-worker-2", "loop-worker", "green"),
    ]
    ports = metrics_ports(settings, [c.name for c in children if c.service != "gateway"])
    for child in children:
        child.metrics_port = ports.get(child.name)
    console = Console(record=True, width=120)
    console.print(
        _banner(
            settings,
            data_dir=tmp_path,
            redis=("external", "redis://x"),
            postgres=("external", "postgresql://x"),
            key_where="here",
            children=children,
        )
    )
    text = console.export_text()
    for where in (
        "http://127.0.0.1:8100/metrics (gateway)",
        "http://127.0.0.1:8101/metrics (tool-runner)",
        "http://127.0.0.1:8102/metrics (loop-worker-1)",
        "http://127.0.0.1:8103/metrics (loop-worker-2)",
    ):
        assert where in text, text
