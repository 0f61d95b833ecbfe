"""``EngineEnvironment``: one engine of real processes, from its servers to its clean-up.

What it owns it cleans up; what it is given it leaves as it found it (bar
the API key it registers and the workspaces it unmounts):

============== ======================================= =======================================
               given                                   else
============== ======================================= =======================================
Redis          ``redis_url``: used as it is            its own ``redis-server`` (durable,
                                                       restartable), stopped on close
PostgreSQL     ``database_url``: a migrated database,  a fresh database ``<name>_<hex>`` on
               used as it is; or ``postgres_url``: a   that server, or on an embedded
               server to create a fresh database on    PostgreSQL of its own; dropped on close
key prefix     ``prefix``                              ``<name>:<hex>:``, its keys deleted on
                                                       close
directory      ``directory``: kept                     a temporary one, removed on close
workspaces     ``workspace_root``                      ``<directory>/workspaces``
============== ======================================= =======================================

Every workspace mounted under the workspace root is unmounted on close. The
processes are its own children and are all stopped on close (SIGTERM, then
SIGKILL after a grace).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Self

from holdfast_shared.assets import Vault
from holdfast_shared.keys import Keys

from holdfast.embedded import EmbeddedPostgres
from holdfast.testing.cluster import cluster_enabled_at
from holdfast.testing.database import add_api_key, create_database, drop_database
from holdfast.testing.processes import (
    KINDS,
    Kind,
    Process,
    end,
    free_port,
    service_command,
    spawn,
    tail,
)
from holdfast.testing.readiness import NotReady, Readiness
from holdfast.testing.servers import RedisServer, delete_keys
from holdfast.testing.timescale import scaled
from holdfast.testing.workspaces import unmount_workspaces

# On an idle machine; every wait multiplies it by time_scale() (timescale.py).
READY_TIMEOUT_SECONDS = 60.0
STOP_GRACE_SECONDS = 15.0
POLL_SECONDS = 0.05

# Settings of the engine that differ from a production start, unless ``env`` says otherwise.
DEFAULTS = {"HOLDFAST_MODEL": "scripted", "HOLDFAST_LOG_LEVEL": "INFO"}
# Set by the environment itself: for all its processes, or per gateway.
OWN_VARIABLES = frozenset(
    {
        "HOLDFAST_REDIS_URL",
        "HOLDFAST_DATABASE_URL",
        "HOLDFAST_REDIS_PREFIX",
        "HOLDFAST_WORKSPACE_ROOT",
        "HOLDFAST_HOST",
        "HOLDFAST_PORT",
    }
)


class EngineEnvironment:
    """Redis, PostgreSQL, a key prefix, an API key and the engine's processes.

    Creating one sets up the servers and the database (blocking; see the
    module docstring for what it owns); :meth:`start` starts a service and
    waits until it is ready by the one readiness rule
    (:mod:`holdfast.testing.readiness`); :meth:`close` (or the end of a
    ``with`` block) stops and removes everything it owns.

    ``env`` holds variables for every process: the engine's ``HOLDFAST_*``
    settings, a provider's key. They start from this process's environment
    without its ``HOLDFAST_*`` variables; unless ``env`` says otherwise the
    model is ``scripted``, the log level INFO and the Asset Directory's key
    (``HOLDFAST_ASSET_ENCRYPTION_KEY``) one generated for the environment. The URLs, the prefix and
    the workspace root are the environment's own (parameters, not ``env``).
    Each process writes its output to ``<log_dir>/<kind>-<n>.log``.

    Blocking throughout; from async code, start with ``wait=False`` and
    ``await`` :meth:`until_ready`, or call the rest through
    ``asyncio.to_thread``.
    """

    def __init__(
        self,
        *,
        redis_url: str | None = None,
        postgres_url: str | None = None,
        database_url: str | None = None,
        prefix: str | None = None,
        directory: str | os.PathLike[str] | None = None,
        workspace_root: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "hftest",
        tenant: str = "test",
        api_key: str | None = None,
    ) -> None:
        if postgres_url is not None and database_url is not None:
            raise ValueError("give postgres_url (a fresh database) or database_url, not both")
        _refuse_own_variables(env)
        self.run_id = secrets.token_hex(4)
        self.tenant = tenant
        self._processes: list[Process] = []
        self._started: Counter[str] = Counter()
        self._closed = False
        self._own_directory = not directory
        self.directory = Path(directory or tempfile.mkdtemp(prefix=f"{name}-"))
        self.log_dir = self.directory / "logs"
        self.workspace_root = Path(workspace_root or self.directory / "workspaces")
        self._own_prefix = prefix is None
        self.prefix = f"{name}:{self.run_id}:" if prefix is None else prefix
        self.redis: RedisServer | None = None  # its own Redis, if it has one
        self._postgres: EmbeddedPostgres | None = None
        self._created: tuple[str, str] | None = None  # (server URL, name) of its database
        self._readiness: Readiness | None = None
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.workspace_root.mkdir(mode=0o700, parents=True, exist_ok=True)
            if redis_url is None:
                self.redis = RedisServer(self.directory / "redis")
                self.redis.start()
                redis_url = self.redis.url
            self.redis_url: str = redis_url
            if database_url is None:
                if postgres_url is None:
                    self._postgres = EmbeddedPostgres(self.directory / "postgres")
                    self._postgres.start()
                    postgres_url = self._postgres.admin_url
                database_name = f"{name}_{self.run_id}"
                database_url = create_database(postgres_url, database_name)
                self._created = (postgres_url, database_name)
            self.database_url: str = database_url
            self.api_key = add_api_key(database_url, tenant, api_key)
            self.env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")}
            self.env.update(
                DEFAULTS,
                HOLDFAST_DATA_DIR=str(self.directory / "data"),
                # A gateway refuses to start without one; every process of the
                # engine must share it (the runner opens what the gateway sealed).
                HOLDFAST_ASSET_ENCRYPTION_KEY=Vault.generate_key(),
            )
            self.env.update(env or {})
            if "HOLDFAST_REDIS_CLUSTER" not in self.env and cluster_enabled_at(self.redis_url):
                # A node of a Redis Cluster: the engine runs on the cluster client.
                self.env["HOLDFAST_REDIS_CLUSTER"] = "true"
            self.env.update(
                HOLDFAST_REDIS_URL=self.redis_url,
                HOLDFAST_DATABASE_URL=self.database_url,
                HOLDFAST_REDIS_PREFIX=self.prefix,
                HOLDFAST_WORKSPACE_ROOT=str(self.workspace_root),
            )
            self._readiness = Readiness(
                self.redis_url,
                Keys(self.prefix),
                cluster=self.env.get("HOLDFAST_REDIS_CLUSTER", "").lower() in ("1", "true", "yes"),
            )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- processes -----------------------------------------------------------
    @property
    def processes(self) -> list[Process]:
        """The processes started and not killed yet (some may have exited on their own)."""
        return list(self._processes)

    def of(self, kind: Kind) -> list[Process]:
        return [p for p in self._processes if p.kind == kind]

    @property
    def url(self) -> str:
        """The base URL of the first running gateway."""
        for process in self._processes:
            if process.kind == "gateway" and process.alive and process.url:
                return process.url
        raise RuntimeError("no gateway runs in this environment: start('gateway') first")

    def start(
        self,
        kind: Kind,
        *,
        env: Mapping[str, str] | None = None,
        command: Sequence[str] | None = None,
        wait: bool = True,
        within: float | None = None,
    ) -> Process:
        """Start one process of ``kind``; with ``wait``, return once it is ready.

        ``env`` adds settings for this process only. ``command`` replaces
        ``python -m holdfast <kind>`` (an instrumented entry point, say); it
        must be the service itself, not a shell around it, since the rule
        finds a worker or runner by its pid. A process that exits or is not
        ready ``within`` seconds (default: ``READY_TIMEOUT_SECONDS``, scaled
        to the machine) is killed, and :class:`NotReady` (with the tail of
        its log) is raised.
        """
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
        if self._closed:
            raise RuntimeError("this environment is closed")
        _refuse_own_variables(env)
        self._started[kind] += 1
        name = f"{kind}-{self._started[kind]}"
        process_env = {**self.env, **(env or {})}
        url = None
        if kind == "gateway":
            port = free_port()
            process_env.update(HOLDFAST_HOST="127.0.0.1", HOLDFAST_PORT=str(port))
            url = f"http://127.0.0.1:{port}"
        log = self.log_dir / f"{name}.log"
        popen = spawn(command or service_command(kind), process_env, log)
        process = Process(kind, name, popen, log, url)
        self._processes.append(process)
        if wait:
            try:
                self.wait_ready(process, within=within)
            except NotReady:
                self.kill(process)
                raise
        return process

    def ready(self, process: Process) -> bool:
        """Whether ``process`` is ready now by the rule (and, if so, marks it ``ready``)."""
        assert self._readiness is not None
        if self._readiness(process):
            process.ready = True
        return process.ready and process.alive

    def wait_ready(self, *processes: Process, within: float | None = None) -> None:
        """Return once every one of ``processes`` is ready; :class:`NotReady` if
        one exits first or is not ready ``within`` seconds (default:
        ``READY_TIMEOUT_SECONDS`` times :func:`~holdfast.testing.time_scale`)."""
        within = scaled(READY_TIMEOUT_SECONDS) if within is None else within
        deadline = time.monotonic() + within
        pending = [p for p in processes if not p.ready]
        while pending:
            pending = self._look(pending, deadline, within)
            if pending:
                time.sleep(POLL_SECONDS)

    async def until_ready(self, *processes: Process, within: float | None = None) -> None:
        """:meth:`wait_ready` for async code: the event loop keeps running meanwhile."""
        within = scaled(READY_TIMEOUT_SECONDS) if within is None else within
        deadline = time.monotonic() + within
        pending = [p for p in processes if not p.ready]
        while pending:
            pending = await asyncio.to_thread(self._look, pending, deadline, within)
            if pending:
                await asyncio.sleep(POLL_SECONDS)

    def _look(self, pending: list[Process], deadline: float, within: float) -> list[Process]:
        """Look at each process once; those still starting."""
        starting = []
        for process in pending:
            if self.ready(process):
                continue
            if not process.alive:
                raise NotReady(
                    f"{process.name} exited with {process.popen.returncode} before it was "
                    f"ready; {process.log} ends with:\n{tail(process.log, 20)}"
                )
            starting.append(process)
        if starting and time.monotonic() > deadline:
            late = starting[0]
            raise NotReady(
                f"{late.name} was not ready in {within:g} s; "
                f"{late.log} ends with:\n{tail(late.log, 20)}"
            )
        return starting

    def kill(
        self, process: Process, sig: int = signal.SIGKILL, *, grace: float = STOP_GRACE_SECONDS
    ) -> int:
        """Send ``sig`` (a signal that ends it: SIGKILL, SIGTERM, SIGINT) to
        ``process`` and reap it, with SIGKILL if it still runs after ``grace``
        seconds; it leaves the environment. Returns its exit status."""
        if process in self._processes:
            self._processes.remove(process)
        end([process.popen], sig, grace)
        assert process.popen.returncode is not None
        return process.popen.returncode

    def kill_all(
        self,
        sig: int = signal.SIGKILL,
        *,
        grace: float = STOP_GRACE_SECONDS,
        kind: Kind | None = None,
    ) -> None:
        """:meth:`kill` every process (of ``kind``) at once: with SIGKILL, a
        machine losing power as far as the engine can tell."""
        victims = [p for p in self._processes if kind is None or p.kind == kind]
        self._processes = [p for p in self._processes if p not in victims]
        end((p.popen for p in victims), sig, grace)

    def log_tail(self, *processes: Process, lines: int = 20) -> str:
        """The last ``lines`` of the logs of ``processes``, or of every process it started."""
        paths = [p.log for p in processes] or sorted(self.log_dir.glob("*.log"))
        return "\n".join(f"--- {path.name}\n{tail(path, lines)}" for path in paths)

    # -- Redis ---------------------------------------------------------------
    def kill_redis(self) -> None:
        """SIGKILL its own Redis (durable: it loses nothing it acknowledged)."""
        self._own_redis().kill()

    def start_redis(self) -> None:
        """Start its own Redis again (same URL); return once it answers."""
        self._own_redis().start()

    def restart_redis(self, outage_seconds: float = 0.0) -> None:
        """Crash its own Redis (SIGKILL), wait ``outage_seconds``, start it again."""
        self.kill_redis()
        time.sleep(outage_seconds)
        self.start_redis()

    def _own_redis(self) -> RedisServer:
        if self.redis is None:
            raise RuntimeError("this environment was given its Redis (redis_url): not its to kill")
        return self.redis

    def delete_keys(self) -> int:
        """Delete every Redis key under the prefix; how many there were."""
        return delete_keys(self.redis_url, self.prefix)

    # -- PostgreSQL ----------------------------------------------------------
    def add_api_key(self, tenant: str, key: str | None = None) -> str:
        """Register another API key (generated when not given) for ``tenant``."""
        return add_api_key(self.database_url, tenant, key)

    # -- the end -------------------------------------------------------------
    def close(self) -> None:
        """Stop every process, then remove what the environment owns. Idempotent."""
        if self._closed:
            return
        self._closed = True
        steps: list[Callable[[], object]] = [
            lambda: self.kill_all(signal.SIGTERM),
            self._close_readiness,
            self._delete_own_keys,
            self._drop_own_database,
            lambda: unmount_workspaces(self.workspace_root),
            self._stop_own_servers,
            self._remove_own_directory,
        ]
        failed: Exception | None = None
        for step in steps:
            try:
                step()
            except Exception as exc:  # the other steps still run
                failed = failed or exc
        if failed is not None:
            raise failed

    def _close_readiness(self) -> None:
        if self._readiness is not None:
            self._readiness.close()

    def _delete_own_keys(self) -> None:
        if self._own_prefix and self._readiness is not None:
            if self.redis is None or self.redis.running:
                self.delete_keys()

    def _drop_own_database(self) -> None:
        if self._created is not None:
            drop_database(*self._created)

    def _stop_own_servers(self) -> None:
        try:
            if self.redis is not None:
                self.redis.stop()
        finally:
            if self._postgres is not None:
                self._postgres.stop()

    def _remove_own_directory(self) -> None:
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def _refuse_own_variables(env: Mapping[str, str] | None) -> None:
    taken = sorted(OWN_VARIABLES & set(env or {}))
    if taken:
        raise ValueError(
            f"{', '.join(taken)}: set by the environment itself (its parameters), not in env"
        )
