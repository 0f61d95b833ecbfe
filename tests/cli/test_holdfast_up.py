"""`holdfast up` from the outside: embedded servers, a turn, a restart that keeps everything."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from holdfast.testing import time_scale
from tests.processes import free_port
from tests.sse_client import execute, replay, stream

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

KEY = "hf_up_test_key_0123456789abcdef"


def start_up(data_dir: Path, port: int, log: Path, **extra: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")}
    env.update(
        HOLDFAST_DATA_DIR=str(data_dir),
        HOLDFAST_PORT=str(port),
        HOLDFAST_API_KEY=KEY,
        HOLDFAST_MODEL="scripted",
        HOLDFAST_HEARTBEAT_SECONDS="1",
        **extra,
    )
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "holdfast", "up"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"holdfast up exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"not healthy: {log.read_text()[-3000:]}"
        time.sleep(0.25)
    # The gateway answers before a loop-worker may be up: wait for one.
    while True:
        assert time.monotonic() < deadline, "no loop-worker came up"
        probe = httpx.post(
            f"http://127.0.0.1:{port}/execute",
            json={"message": "ping", "model": "scripted", "task_id": "readiness"},
            headers={"X-Engine-Key": KEY},
            timeout=30,
        )
        if probe.status_code == 200:
            break
        time.sleep(0.25)
    return proc


def stop_up(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0


async def test_restart_keeps_tasks_and_events(tmp_path: Path) -> None:
    data_dir, log = tmp_path / "data", tmp_path / "up.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_up(data_dir, port, log)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            first = await execute(client, base, KEY, {"message": "before restart"})
        task_id = first.headers["x-task-id"]
        assert first.events[-1]["phase"] == "completed"
    finally:
        stop_up(proc)
    assert (data_dir / "redis").exists() and (data_dir / "postgres").exists()

    proc = start_up(data_dir, port, log)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            replayed = await replay(client, base, KEY, {"task_id": task_id, "after": 0})
            second = await execute(
                client, base, KEY, {"message": "after restart", "task_id": task_id}
            )
    finally:
        stop_up(proc)
    assert replayed.events == first.events
    assert second.seqs[0] == first.seqs[-1] + 1
    assert second.text == "You said: after restart Earlier you said: before restart"
    # Quiet at INFO while nothing happens: arq's line per cron job (the learning
    # sweep runs at start and every 10 s) stays off the terminal.
    output = log.read_text()
    assert "learning centre started" in output
    assert "learning-sweep" not in output


def kill_everything(proc: subprocess.Popen[bytes], data_dir: Path) -> int:
    """kill -9 the supervisor, every service, and the embedded Redis and PostgreSQL."""
    victims = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for candidate in psutil.process_iter(["cmdline"]):
        if str(data_dir) in " ".join(candidate.info["cmdline"] or []):
            victims.append(candidate)
    for victim in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            victim.kill()
    psutil.wait_procs(victims, timeout=10)
    proc.wait()
    return len(victims)


async def test_kill_9_of_everything_then_the_next_start_finishes_the_turn(
    tmp_path: Path,
) -> None:
    data_dir, log = tmp_path / "data", tmp_path / "up.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    fast = {"HOLDFAST_LEASE_SECONDS": "2"}
    proc = start_up(data_dir, port, log, **fast)
    message = "/script " + json.dumps({"text": "k ", "deltas": 80, "delay_ms": 50})
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            first = await stream(
                client,
                "POST",
                f"{base}/execute",
                key=KEY,
                limit=10,
                json={"message": message, "task_id": "crashy"},
            )
    finally:
        killed = kill_everything(proc, data_dir)
    assert killed >= 6, "supervisor, services, redis-server and postgres"

    proc = start_up(data_dir, port, log, **fast)
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            deadline = time.monotonic() + 90
            while True:
                rest = await replay(
                    client, base, KEY, {"task_id": "crashy", "after_seq": first.seqs[-1]}
                )
                if rest.events and rest.events[-1]["type"] == "thread_lifecycle":
                    break
                assert time.monotonic() < deadline, "the turn was not finished after restart"
                await asyncio.sleep(0.5)
    finally:
        stop_up(proc)
    events = first.events + rest.events
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["phase"] == "completed"
    assert "turn_resumed" in rest.types


def _pid_in(pidfile: Path) -> int:
    return int(pidfile.read_text().split()[0])


async def _finish_of(
    base: str, task_id: str, after_seq: int, within: float
) -> list[dict[str, Any]]:
    """The task's events after ``after_seq`` once its turn has ended (replayed until then)."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            try:
                rest = await replay(client, base, KEY, {"task_id": task_id, "after_seq": after_seq})
                if rest.events and rest.events[-1]["type"] == "thread_lifecycle":
                    return rest.events
            except httpx.HTTPError:
                pass  # the gateway may answer 503 (or not at all) while a server is down
            assert time.monotonic() < deadline, f"the turn of {task_id} did not end"
            await asyncio.sleep(0.5)


def _text_as_shown(events: list[dict[str, Any]]) -> str:
    """The turn's text as a client shows it: a resume discards the cut-off output from
    ``discard_from_seq`` on, which then comes again."""
    shown: list[dict[str, Any]] = []
    for event in events:
        if event["type"] == "turn_resumed" and event.get("discard_from_seq") is not None:
            shown = [e for e in shown if e["seq"] < event["discard_from_seq"]]
        elif event["type"] == "text_delta":
            shown.append(event)
    return "".join(e["text"] for e in shown)


@pytest.mark.parametrize("server", ["redis", "postgres"])
async def test_an_embedded_server_that_dies_is_restarted_on_its_data(
    tmp_path: Path, server: str
) -> None:
    """SIGKILL of the embedded Redis or PostgreSQL: ``holdfast up`` starts it again on the
    same files, a task's earlier events still replay and its next turn sees them.

    A turn in flight completes across either crash: a store that is restarting
    stops the turn as a crash would, and it resumes once the store answers.
    """
    data_dir, log = tmp_path / "data", tmp_path / "up.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    pidfile = data_dir / ("redis/redis.pid" if server == "redis" else "postgres/postmaster.pid")
    proc = start_up(data_dir, port, log, HOLDFAST_LEASE_SECONDS="2")
    long = "/script " + json.dumps({"text": "k ", "deltas": 60, "delay_ms": 50})
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            earlier = await execute(client, base, KEY, {"message": "before", "task_id": "kept"})
            assert earlier.events[-1]["phase"] == "completed"
            first = await stream(
                client, "POST", f"{base}/execute", key=KEY, limit=5,
                json={"message": long, "task_id": "in-flight"},
            )  # fmt: skip
        victim = _pid_in(pidfile)
        os.kill(victim, signal.SIGKILL)

        # Restarted: a new server process writes its pid on the same data directory.
        deadline = time.monotonic() + 90 * time_scale()
        while True:
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = _pid_in(pidfile)
                if pid != victim and psutil.pid_exists(pid):
                    break
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"not restarted: {log.read_text()[-3000:]}"
            await asyncio.sleep(0.2)
        name = "Redis" if server == "redis" else "PostgreSQL"
        assert f"the embedded {name} died" in log.read_text()

        rest = await _finish_of(base, "in-flight", first.seqs[-1], 120 * time_scale())
        events = first.events + rest
        assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
        assert events[-1]["phase"] == "completed", [
            (e["error"], e["message"]) for e in events if e["type"] == "error"
        ]
        assert _text_as_shown(events).count("k") == 60

        async with httpx.AsyncClient(timeout=30) as client:
            # A gateway's pooled connections to the dead server fail once each:
            # 503 with Retry-After, as for any outage; a client tries again.
            deadline = time.monotonic() + 60 * time_scale()
            while True:
                replayed = await replay(client, base, KEY, {"task_id": "kept", "after": 0})
                if replayed.status != 503 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(float(replayed.headers.get("retry-after", 1)))
            again = await execute(client, base, KEY, {"message": "after", "task_id": "kept"})
        assert replayed.status == 200, (replayed.status, replayed.body)
        assert replayed.events == earlier.events
        assert again.text == "You said: after Earlier you said: before"
    finally:
        stop_up(proc)


async def _held_open(
    client: httpx.AsyncClient, method: str, url: str, opened: asyncio.Event, **kwargs: Any
) -> list[dict[str, Any]]:
    """Read an SSE stream until the server ends it; ``opened`` is set at its first frame."""
    events: list[dict[str, Any]] = []
    # A stream the server cuts off may end without the chunked body's last
    # chunk: that is an end too, the client reconnects from its cursor.
    with contextlib.suppress(httpx.RemoteProtocolError, httpx.ReadError):
        async with client.stream(method, url, headers={"X-Engine-Key": KEY}, **kwargs) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                opened.set()
                if line.startswith("data: "):
                    event = json.loads(line[len("data: ") :])
                    if event["type"] != "heartbeat":
                        events.append(event)
    return events


_SERVICES_STOPPED = "All services stopped."


def _services_stopped(proc: subprocess.Popen[bytes], log: Path, before: int) -> float:
    """Seconds until ``holdfast up`` says its services stopped (or it exits): its
    output goes to a file, read until the line is there."""
    started = time.monotonic()
    while log.read_text().count(_SERVICES_STOPPED) == before and proc.poll() is None:
        time.sleep(0.05)
    return time.monotonic() - started


async def test_ctrl_c_is_not_held_by_open_streams_or_a_running_turn(tmp_path: Path) -> None:
    """Ctrl-C with a turn streaming and a console-like ``follow=task`` stream open: the
    gateway ends both streams at once and the loop-worker hands the turn back after a
    short drain, well within the services' stop grace; the next start finishes the turn.
    """
    data_dir, log = tmp_path / "data", tmp_path / "up.log"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_up(data_dir, port, log)
    long = "/script " + json.dumps({"text": "k ", "deltas": 300, "delay_ms": 50})
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=None)) as client:
            turn_open, follow_open = asyncio.Event(), asyncio.Event()
            turn = asyncio.create_task(
                _held_open(
                    client, "POST", f"{base}/execute", turn_open,
                    json={"message": long, "task_id": "long"},
                )
            )  # fmt: skip
            await asyncio.wait_for(turn_open.wait(), 30 * time_scale())
            follow = asyncio.create_task(
                _held_open(
                    client, "GET", f"{base}/execute/replay", follow_open,
                    params={"task_id": "long", "after_seq": 0, "follow": "task"},
                )
            )  # fmt: skip
            await asyncio.wait_for(follow_open.wait(), 30 * time_scale())

            stops_before = log.read_text().count(_SERVICES_STOPPED)
            proc.send_signal(signal.SIGINT)
            took = await asyncio.to_thread(_services_stopped, proc, log, stops_before)
            status = await asyncio.to_thread(proc.wait, 60)
            # Both streams ended with the gateway, neither was left hanging.
            streamed, followed = await asyncio.wait_for(asyncio.gather(turn, follow), 10)
    finally:
        if proc.poll() is None:
            stop_up(proc)
    assert status == 0
    # The services' grace is 10 s (supervisor.STOP_GRACE_SECONDS): a stop held by a
    # stream or a draining turn would reach it; the bound scales with the machine.
    # Timed to the services' stop: the embedded servers' own (PostgreSQL's shutdown
    # checkpoint) follows, and on a busy disk it is no measure of what this tests.
    shown = log.read_text()
    stopping = shown[shown.rfind("Ctrl-C to stop") :]
    assert "did not stop within" not in shown, stopping
    bound = 8 * time_scale()
    assert took < bound, f"Ctrl-C took {took:.1f} s (bound {bound:.1f} s):\n{stopping}"
    assert streamed and followed

    proc = start_up(data_dir, port, log)
    try:
        rest = await _finish_of(base, "long", streamed[-1]["seq"], 120 * time_scale())
    finally:
        stop_up(proc)
    assert rest[-1]["phase"] == "completed"
    assert _text_as_shown(streamed + rest).count("k") == 300
