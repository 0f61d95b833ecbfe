"""The one readiness rule: a process is ready when it says so itself.

* a **gateway** when ``GET /health`` answers 200 with ``"status": "ok"``: it
  listens, and Redis and PostgreSQL answer it;
* a **tool-runner** when its liveness key ``Keys.runner_alive(<host>-<pid>)``
  exists: it probed its sandbox, announced what it can do, and consumes next;
* a **loop-worker** when its registration ``Keys.worker_alive(<host>-<pid>)``
  exists: its providers are advertised (the gateway accepts turns for them),
  and it consumes next;
* a **learning** process when its ``Keys.learner_alive(<host>-<pid>)`` exists:
  its consumer group exists and it reads trajectories next.

The consumer groups read from the start of their streams, so a job queued
between a worker's registration and its first read waits for it; nothing is
lost. No log is read and no delay is guessed.
"""

from __future__ import annotations

import http.client
import json
import urllib.request

import redis
from holdfast_shared.keys import Keys
from holdfast_shared.redisconn import connect_sync

from holdfast.testing.processes import Process

HTTP_TIMEOUT_SECONDS = 1.0

# The probes go to 127.0.0.1: never through a proxy named in the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class NotReady(RuntimeError):
    """A process exited, or did not become ready in time; the message ends
    with the tail of its log."""


def gateway_healthy(url: str) -> bool:
    """Whether the gateway at ``url`` answers ``GET /health`` with 200 and status ok."""
    try:
        with _NO_PROXY.open(f"{url}/health", timeout=HTTP_TIMEOUT_SECONDS) as response:
            return bool(response.status == 200 and json.load(response).get("status") == "ok")
    except (OSError, ValueError, http.client.HTTPException):  # refused, 503, half an answer
        return False


class Readiness:
    """The rule for one environment: its Redis, its key prefix.

    Blocking (one HTTP request or one Redis command per look), and safe to
    call from several threads at once.
    """

    def __init__(self, redis_url: str, keys: Keys, *, cluster: bool = False) -> None:
        self.keys = keys
        self._redis = connect_sync(redis_url, timeout=2, cluster=cluster)

    def registration(self, process: Process) -> str | None:
        """The Redis key whose presence says ``process`` is ready (None: a gateway)."""
        if process.kind == "loop-worker":
            return self.keys.worker_alive(process.ident)
        if process.kind == "tool-runner":
            return self.keys.runner_alive(process.ident)
        if process.kind == "learning":
            return self.keys.learner_alive(process.ident)
        return None

    def __call__(self, process: Process) -> bool:
        """Whether ``process`` is alive and ready now."""
        if not process.alive:
            return False
        key = self.registration(process)
        if key is None:
            assert process.url is not None
            return gateway_healthy(process.url)
        try:
            return bool(self._redis.exists(key))
        except redis.RedisError:  # Redis restarting: not ready yet
            return False

    def close(self) -> None:
        self._redis.close()
