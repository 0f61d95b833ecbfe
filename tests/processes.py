"""Engine services as real child processes, the way ``holdfast`` runs them."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineProcesses:
    def __init__(self, env: dict[str, str], log_dir: Path | None = None) -> None:
        self.env = env
        self.gateways: list[tuple[subprocess.Popen[bytes], str]] = []
        self.workers: list[subprocess.Popen[bytes]] = []
        self.runners: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return self.gateways[0][1]

    def _spawn(self, service: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "holdfast", service],
            env=env,
            stdin=subprocess.DEVNULL,
        )

    def start_gateway(self) -> str:
        port = free_port()
        env = {**self.env, "HOLDFAST_PORT": str(port), "HOLDFAST_HOST": "127.0.0.1"}
        proc = self._spawn("gateway", env)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("gateway did not become healthy in 30 s")
            time.sleep(0.1)
        self.gateways.append((proc, url))
        return url

    def start_worker(self) -> subprocess.Popen[bytes]:
        """Start a loop-worker and wait until it advertises its providers (it is ready)."""
        import redis

        client = redis.Redis.from_url(self.env["HOLDFAST_REDIS_URL"])
        key = f"{self.env['HOLDFAST_REDIS_PREFIX']}providers"
        client.delete(key)
        proc = self._spawn("loop-worker", self.env)
        deadline = time.monotonic() + 30
        try:
            while not client.zrangebyscore(key, int(time.time() * 1000), "+inf"):
                if proc.poll() is not None:
                    raise RuntimeError(f"loop-worker exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError("loop-worker did not become ready in 30 s")
                time.sleep(0.05)
        finally:
            client.close()
        self.workers.append(proc)
        return proc

    def start_tool_runner(self) -> subprocess.Popen[bytes]:
        proc = self._spawn("tool-runner", self.env)
        self.runners.append(proc)
        return proc

    def kill_all(self) -> None:
        """SIGKILL every process at once (a machine losing power, as far as they know)."""
        for proc in [p for p, _ in self.gateways] + self.workers + self.runners:
            if proc.poll() is None:
                proc.kill()
        for proc in [p for p, _ in self.gateways] + self.workers + self.runners:
            proc.wait()
        self.gateways, self.workers, self.runners = [], [], []

    def stop(self) -> None:
        procs = [p for p, _ in self.gateways] + self.workers + self.runners
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def unmount_workspaces(root: Path | str | None) -> None:
    """Each workspace is a filesystem of its own (the tool-runner's
    workspaces.py); they stay mounted when the runners stop, as they should
    for a later runner. A test's directory goes away, so its mounts go first."""
    if not root:
        return
    prefix = f"{root}/"
    points = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for point in sorted((p for p in points if p.startswith(prefix)), reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)


@contextlib.contextmanager
def running_engine(
    env: dict[str, str], *, workers: int = 1, runners: int = 0, gateways: int = 1
) -> Iterator[EngineProcesses]:
    """An engine of real processes for a fixture; stopped (SIGTERM) at the end."""
    procs = EngineProcesses(env)
    try:
        for _ in range(runners):
            procs.start_tool_runner()
        for _ in range(workers):
            procs.start_worker()
        for _ in range(gateways):
            procs.start_gateway()
        yield procs
    finally:
        procs.stop()
        unmount_workspaces(env.get("HOLDFAST_WORKSPACE_ROOT"))
