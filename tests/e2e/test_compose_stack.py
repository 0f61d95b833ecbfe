"""compose.yaml, proven: the whole stack in containers, a loop-worker killed mid-turn.

The images come from ``docker/build-images.sh`` (Debian's packages and PyPI,
no registry): a first run builds them (minutes), later runs find them by the
hash of their inputs. The stack runs with ``docker/compose.local.yaml`` under a
project name of its own, on a free port, and is removed with its volumes after.

Skipped, saying why, when no Docker daemon answers or the images cannot be built.
"""

from __future__ import annotations

import base64
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "docker" / "build-images.sh"
COMPOSE_FILES = [
    "-f",
    str(ROOT / "compose.yaml"),
    "-f",
    str(ROOT / "docker" / "compose.local.yaml"),
]
# A cold build (debootstrap, PostgreSQL, pgvector from source, the Python
# dependencies) takes some minutes on two cores; a warm one seconds.
BUILD_TIMEOUT = 1800
STACK_TIMEOUT = 240
# The build runs in the module's fixture, which pytest-timeout counts with the
# test: past its default 120 s, a cold build failed the test before it started.
pytestmark = [pytest.mark.compose, pytest.mark.timeout(BUILD_TIMEOUT + 2 * STACK_TIMEOUT + 300)]


def _docker_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    try:
        probe = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        return "the Docker daemon did not answer within 20 s"
    if probe.returncode != 0:
        return f"no Docker daemon answers: {probe.stderr.strip()[-300:]}"
    return None


def _build_images() -> str | None:
    """Build or reuse the images; why they cannot be had, or None."""
    try:
        built = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return f"docker/build-images.sh took over {BUILD_TIMEOUT} s"
    if built.returncode != 0:
        return f"docker/build-images.sh failed: {built.stderr.strip()[-1500:]}"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    url: str
    key: str

    def compose(self, *args: str, timeout: float = 180) -> str:
        done = subprocess.run(
            ["docker", "compose", *COMPOSE_FILES, "-p", self.project, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=self.env,
        )
        assert done.returncode == 0, f"docker compose {' '.join(args)}: {done.stderr[-2000:]}"
        return done.stdout

    def sql(self, query: str) -> str:
        return self.compose(
            "exec", "-T", "postgres", "psql", "-U", "holdfast", "-d", "holdfast", "-Atc", query
        ).strip()

    def logs(self) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", "60", timeout=60)[-6000:]
        except AssertionError as error:
            return str(error)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    reason = _docker_unavailable() or _build_images()
    if reason is not None:
        pytest.skip(reason)
    port = _free_port()
    key = secrets.token_hex(32)
    env = {
        **os.environ,
        "HOLDFAST_API_KEY": key,
        "HOLDFAST_ASSET_ENCRYPTION_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
        "HOLDFAST_PORT": str(port),
    }
    running = Stack(f"hfcompose{os.getpid()}{secrets.token_hex(3)}", env, "", key)
    running.url = f"http://127.0.0.1:{port}"
    try:
        running.compose("up", "-d", "--no-build", timeout=STACK_TIMEOUT)
        _wait_healthy(running)
        yield running
    finally:
        subprocess.run(
            [
                "docker",
                "compose",
                *COMPOSE_FILES,
                "-p",
                running.project,
                "down",
                "-v",
                "--remove-orphans",
                "-t",
                "5",
            ],
            capture_output=True,
            timeout=180,
            cwd=ROOT,
            env=env,
        )


def _wait_healthy(stack: Stack) -> None:
    deadline = time.monotonic() + STACK_TIMEOUT
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            health = httpx.get(f"{stack.url}/health", timeout=5)
            if health.status_code == 200:
                # Takeover needs a second worker: wait until both have registered.
                workers = stack.compose("ps", "-q", "--status", "running", "loop-worker").split()
                if len(workers) == 2:
                    return
                last = f"{len(workers)} loop-workers running"
            else:
                last = f"{health.status_code} {health.text[:300]}"
        except httpx.HTTPError as error:
            last = repr(error)
        time.sleep(2)
    pytest.fail(f"the stack did not become healthy: {last}\n{stack.logs()}")


def _events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The logged events of an SSE response (heartbeats, which have no id, left out)."""
    data: list[str] = []
    for line in response.iter_lines():
        if line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "" and data:
            event = json.loads("\n".join(data))
            data = []
            if event["type"] != "heartbeat":
                yield event


def test_turn_survives_killed_loop_worker_container(stack: Stack) -> None:
    # 30 deltas 150 ms apart: a turn of about 4.5 s to kill its worker in.
    script = {"text": "tick ", "deltas": 30, "delay_ms": 150}
    body = {"message": f"/script {json.dumps(script)}", "task_id": "compose-1", "model": "scripted"}
    headers = {"X-Engine-Key": stack.key}
    got: list[dict[str, Any]] = []
    killed = killed_owner = taken_by = ""
    with httpx.Client(base_url=stack.url, headers=headers, timeout=60) as client:
        _wait_for_workers(client)
        with client.stream("POST", "/execute", json=body) as response:
            assert response.status_code == 200, response.read()
            for event in _events(response):
                got.append(event)
                if not killed and event["type"] == "text_delta":
                    killed, killed_owner = _kill_turns_worker(stack, event["turn_id"])
                elif killed and taken_by in ("", killed_owner):
                    # The lease names the dead worker until another claims the turn.
                    taken_by = _lease_owner(stack, event["turn_id"])
                if event["type"] == "thread_lifecycle" and event["phase"] in (
                    "completed",
                    "errored",
                ):
                    break
        assert killed, "the turn ended before its worker was found"
        assert got[-1]["type"] == "thread_lifecycle", stack.logs()
        assert got[-1]["phase"] == "completed", got[-1]
        seqs = [event["seq"] for event in got]
        assert seqs == list(range(1, len(got) + 1)), f"gaps or repeats: {seqs}"

        # Another worker took the lease over from the dead one and finished the turn.
        assert taken_by, "nobody took the turn's lease over"
        assert taken_by != killed_owner, (taken_by, killed_owner)
        restarts = subprocess.run(
            ["docker", "inspect", "--format", "{{.RestartCount}} {{.State.Status}}", killed],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        print(f"killed {killed_owner}; taken over by {taken_by}; killed container: {restarts}")

        # Replay by seq gives every event once, exactly as streamed live.
        with client.stream(
            "GET", "/execute/replay", params={"task_id": "compose-1", "after_seq": 0}
        ) as replay:
            assert replay.status_code == 200
            replayed = []
            for event in _events(replay):
                replayed.append(event)
                if event["seq"] == got[-1]["seq"]:
                    break
        assert replayed == got


def _wait_for_workers(client: httpx.Client) -> None:
    """Until a loop-worker has advertised the scripted provider (the gateway
    refuses a turn no live worker can serve, writing nothing)."""
    deadline = time.monotonic() + 90
    probe = {"message": "hello", "task_id": "compose-probe", "model": "scripted"}
    while True:
        with client.stream("POST", "/execute", json=probe) as response:
            if response.status_code == 200:
                for _ in _events(response):
                    pass
                return
            refused = json.loads(response.read())
        assert refused["error"] == "MODEL_UNAVAILABLE", refused
        assert time.monotonic() < deadline, f"no loop-worker advertised: {refused}"
        time.sleep(1)


def _lease_owner(stack: Stack, turn_id: str) -> str:
    assert re.fullmatch(r"[A-Za-z0-9_-]+", turn_id), turn_id  # spliced into SQL below
    return stack.sql(f"SELECT coalesce(lease_owner, '') FROM turns WHERE id = '{turn_id}'")


def _kill_turns_worker(stack: Stack, turn_id: str) -> tuple[str, str]:
    """SIGKILL the loop-worker container holding the turn's lease: its id and the
    worker id that held the lease."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        owner = _lease_owner(stack, turn_id)
        # A worker's id is "<hostname>-<pid>"; a container's hostname is its short id.
        for container in stack.compose("ps", "-q", "loop-worker").split():
            if owner.startswith(container[:12]):
                subprocess.run(["docker", "kill", container], check=True, capture_output=True)
                return container, owner
        time.sleep(0.2)
    raise AssertionError(f"no loop-worker container holds turn {turn_id}")
