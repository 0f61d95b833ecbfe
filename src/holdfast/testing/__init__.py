"""Test against a real engine: Redis, PostgreSQL and the services as real processes.

The harness ships with the product (as ``temporalio.testing`` does with
Temporal): Holdfast's own test suite, its chaos suite and its bench start
engines through it, and so can you, to test your agents against the very
engine they will run on::

    import httpx
    from holdfast.testing import EngineEnvironment

    with EngineEnvironment() as engine:  # its own Redis and PostgreSQL, a fresh database
        engine.start("tool-runner")
        engine.start("loop-worker")
        gateway = engine.start("gateway")  # each returns once it is ready
        reply = httpx.post(
            f"{gateway.url}/execute",
            headers={"X-Engine-Key": engine.api_key},
            json={"message": "hello", "task_id": "t-1"},
        )
        worker = engine.of("loop-worker")[0]
        engine.kill(worker)  # SIGKILL; its turns are taken over by the next worker
        engine.start("loop-worker")
    # every process stopped, the database dropped, the keys, mounts and files gone

Given ``redis_url`` / ``database_url`` (or ``postgres_url``, a server to
create a fresh database on), it uses those servers instead of starting its
own; ``env`` sets the engine's ``HOLDFAST_*`` settings (the model is
``scripted`` unless it says otherwise). What it guarantees:

* **one readiness rule** (:mod:`holdfast.testing.readiness`): a gateway is
  ready when ``GET /health`` says ``ok``; a loop-worker or a tool-runner when
  its own registration (``Keys.worker_alive`` / ``Keys.runner_alive`` under
  its id ``<host>-<pid>``) exists. No log is read, no delay guessed;
* **isolation**: a fresh database and a key prefix of its own, so several
  environments share one Redis and one PostgreSQL server;
* **per-process logs** in ``engine.log_dir`` (``<kind>-<n>.log``);
* **faults on demand**: :meth:`~EngineEnvironment.kill` a process with any
  signal that ends it, :meth:`~EngineEnvironment.kill_all` at once,
  :meth:`~EngineEnvironment.restart_redis` (its own Redis: durable, so a
  crash loses nothing acknowledged), and a :class:`FaultProxy` to put between
  the engine and any server it uses (latency, bandwidth, resets, blackholes);
* **bounds that scale with the machine**: every wait for readiness is
  multiplied by :func:`time_scale` (``HOLDFAST_TEST_TIME_SCALE``, else the
  load per CPU), and tests multiply their own liveness bounds by it;
* **clean-up** on close: no process left, no key under its prefix, no
  database it created, no workspace mounted under its workspace root, and its
  temporary directory removed (pass ``directory`` to keep the logs).
"""

from holdfast.testing.database import add_api_key, create_database, drop_database
from holdfast.testing.environment import EngineEnvironment
from holdfast.testing.faultproxy import FaultProxy, Faults
from holdfast.testing.processes import KINDS, Kind, Process, free_port
from holdfast.testing.readiness import NotReady
from holdfast.testing.servers import RedisServer, delete_keys
from holdfast.testing.timescale import TIME_SCALE_ENV, scaled, time_scale
from holdfast.testing.workspaces import unmount_workspaces

__all__ = [
    "KINDS",
    "TIME_SCALE_ENV",
    "EngineEnvironment",
    "FaultProxy",
    "Faults",
    "Kind",
    "NotReady",
    "Process",
    "RedisServer",
    "add_api_key",
    "create_database",
    "delete_keys",
    "drop_database",
    "free_port",
    "scaled",
    "time_scale",
    "unmount_workspaces",
]
