"""``holdfast up``: the whole engine on one machine, under one supervisor process.

In order: lock the data directory (one supervisor per directory); start an
embedded Redis / PostgreSQL for each URL left unset; run migrations; make sure
an API key exists, and the Asset Directory's encryption key (kept in
``<data dir>/asset-key`` unless ``HOLDFAST_ASSET_ENCRYPTION_KEY`` is set);
start every service as a child process (``python -m holdfast <service>``)
with the URLs and that key in its environment, and restart any that dies,
with backoff. An embedded server that dies is restarted the same way, on the
same data (Redis replays its AOF, PostgreSQL recovers from its WAL) and at
the same socket, so the services reconnect to the URL they were given and a
turn in flight resumes. On Ctrl-C or SIGTERM: SIGTERM to every
service, SIGKILL to those still running after ``STOP_GRACE_SECONDS``, then
the embedded servers are stopped, and the exit status is 0. The loop-workers
drain for ``UP_DRAIN_SECONDS`` (unless ``HOLDFAST_DRAIN_SECONDS`` is set), so a
turn in flight is snapshotted and handed back well within that grace; the
gateway ends its open streams at once (``holdfast_gateway/sse.py``), and a client
reconnects from its cursor after the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import signal
import sys
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
from holdfast_shared.apikeys import DEFAULT_TENANT, add_key, generate_key, has_any_key
from holdfast_shared.assets import Vault
from holdfast_shared.db import create_engine, session_factory, upgrade_head
from holdfast_shared.observability.process import metrics_ports
from holdfast_shared.settings import Settings
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from holdfast.defaultmodel import default_model
from holdfast.embedded import EmbeddedPostgres, EmbeddedRedis
from holdfast.supervisor_link import SUPERVISOR_PID_ENV

log = logging.getLogger("holdfast.up")

STOP_GRACE_SECONDS = 10.0
# Every loop-worker of this machine stops at once, so none is left to take a
# drained turn over: waiting out the usual 30 s drain only delays the stop (or,
# past the grace, ends in SIGKILL). A turn still running after this is
# snapshotted and queued, and the next start resumes it.
UP_DRAIN_SECONDS = "2"
BACKOFF_FIRST_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0
# A service that ran this long before dying is restarted without waiting.
STABLE_SECONDS = 30.0
# How often an embedded server is looked at: its death is noticed within this.
WATCH_SECONDS = 0.5
# How often the start looks whether the gateway answers yet.
_READY_POLL_SECONDS = 0.2
KEY_FILE = "api-key"
# The Asset Directory's encryption key, kept next to the data it protects.
ASSET_KEY_FILE = "asset-key"


def run_up(settings: Settings, *, workers: int, console: Console) -> int:
    """Run the engine until Ctrl-C or SIGTERM; return the process exit status."""
    data_dir = settings.data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = _lock(data_dir / "holdfast.lock")
    if lock is None:
        console.print(f"[bold red]error:[/] another `holdfast up` is using {data_dir}")
        return 2
    try:
        return asyncio.run(_up(settings, data_dir, workers, console))
    except Exception:
        log.exception("holdfast up failed")
        return 1
    finally:
        lock.close()


async def _up(settings: Settings, data_dir: Path, workers: int, console: Console) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)

    embedded_redis = None if settings.redis_url else EmbeddedRedis(data_dir / "redis")
    embedded_postgres = None if settings.database_url else EmbeddedPostgres(data_dir / "postgres")
    try:
        with console.status("Starting Redis and PostgreSQL, running migrations…"):
            redis_url = await _url_of(embedded_redis, settings.redis_url)
            database_url = await _url_of(embedded_postgres, settings.database_url)
            await asyncio.to_thread(upgrade_head, database_url)
            new_key, key_where = await _ensure_api_key(
                database_url, settings.api_key, data_dir / KEY_FILE
            )
        if stop.is_set():
            return 0

        children = [
            _Child("tool-runner", "tool-runner", "magenta"),
            _Child("learning", "learning", "yellow"),
            _Child("gateway", "gateway", "cyan"),
            *(
                _Child(f"loop-worker-{n}" if workers > 1 else "loop-worker", "loop-worker", "green")
                for n in range(1, workers + 1)
            ),
        ]
        ports = metrics_ports(settings, [c.name for c in children if c.service != "gateway"])
        for child in children:
            child.metrics_port = ports.get(child.name)
        if new_key is not None:
            _announce_key(console, new_key, data_dir / KEY_FILE)
        banner = _banner(
            settings,
            data_dir=data_dir,
            redis=("embedded" if embedded_redis else "external", redis_url),
            postgres=("embedded" if embedded_postgres else "external", database_url),
            key_where=key_where,
            children=children,
        )
        console.print("Starting the services…")
        env = {
            **os.environ,
            "HOLDFAST_ASSET_ENCRYPTION_KEY": await asyncio.to_thread(
                _asset_key, settings, data_dir / ASSET_KEY_FILE
            ),
            "HOLDFAST_REDIS_URL": redis_url,
            "HOLDFAST_DATABASE_URL": database_url,
            "HOLDFAST_DRAIN_SECONDS": os.environ.get("HOLDFAST_DRAIN_SECONDS", UP_DRAIN_SECONDS),
            SUPERVISOR_PID_ENV: str(os.getpid()),
            # Service logs pass through a pipe; without this they arrive in bursts.
            "PYTHONUNBUFFERED": "1",
        }
        watched = [
            _Watched(name, server)
            for name, server in (("Redis", embedded_redis), ("PostgreSQL", embedded_postgres))
            if server is not None
        ]
        async with asyncio.TaskGroup() as group:
            for server in watched:
                group.create_task(server.keep_running(stop))
            for child in children:
                group.create_task(child.keep_running(env, stop, console))
            # "Up" once a client can reach it: a curl copied from the banner
            # must not meet a refused connection.
            gateway = f"http://{_local(settings.host)}:{settings.port}/health"
            group.create_task(_print_when_answering(console, banner, gateway, stop))
        console.print("All services stopped.")
    finally:
        # The servers outlive the services so that those can flush on SIGTERM.
        if embedded_redis is not None:
            await asyncio.to_thread(embedded_redis.stop)
        if embedded_postgres is not None:
            await asyncio.to_thread(embedded_postgres.stop)
    if embedded_redis or embedded_postgres:
        console.print("Embedded servers stopped.")
    return 0


async def _print_when_answering(
    console: Console, banner: Panel, health_url: str, stop: asyncio.Event
) -> None:
    """Print ``banner`` once the gateway answers ``GET /health`` (whatever it
    says: a degraded engine is up, and its health says why); never, on a stop
    first."""
    async with httpx.AsyncClient(timeout=2) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                answer = await client.get(health_url)
                console.print(banner)
                if answer.status_code != 200:
                    console.print(f"[yellow]health: {answer.text[:300]}[/]")
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _READY_POLL_SECONDS)


def _local(host: str) -> str:
    """Where this machine reaches a server listening on ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


async def _url_of(server: EmbeddedRedis | EmbeddedPostgres | None, configured: str | None) -> str:
    if server is None:
        assert configured is not None
        return configured
    return await asyncio.to_thread(server.start)


@dataclass
class _Watched:
    """An embedded server, started again on its own data whenever it dies, until the stop.

    The restart happens in a thread and is awaited to its end even when the
    stop comes meanwhile, so the final ``stop()`` never races a ``start()``.
    """

    name: str
    server: EmbeddedRedis | EmbeddedPostgres

    async def keep_running(self, stop: asyncio.Event) -> None:
        backoff = BACKOFF_FIRST_SECONDS
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), WATCH_SECONDS)
            if stop.is_set() or await asyncio.to_thread(self.server.running):
                continue
            log.warning(
                "the embedded %s died; restarting it on %s", self.name, self.server.directory
            )
            try:
                await asyncio.to_thread(self.server.start)
            except Exception as error:
                # PostgreSQL refuses to start while the killed postmaster's
                # backends still hold its shared memory; they leave on their own.
                log.warning(
                    "the embedded %s did not start again (%s); retrying in %.0f s",
                    self.name, error, backoff,
                )  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_SECONDS)
                continue
            backoff = BACKOFF_FIRST_SECONDS
            log.warning("the embedded %s is back", self.name)


@dataclass
class _Child:
    """One service process, restarted whenever it dies until the supervisor stops."""

    name: str
    service: str
    style: str
    # Where it serves Prometheus /metrics (the gateway: on its own port).
    metrics_port: int | None = None

    async def keep_running(
        self, env: dict[str, str], stop: asyncio.Event, console: Console
    ) -> None:
        loop = asyncio.get_running_loop()
        backoff = BACKOFF_FIRST_SECONDS
        while not stop.is_set():
            started = loop.time()
            status = await self._run_once(env, stop, console)
            if stop.is_set():
                return
            if loop.time() - started >= STABLE_SECONDS:
                backoff = BACKOFF_FIRST_SECONDS
            log.warning(
                "%s exited with status %s; restarting in %.0f s", self.name, status, backoff
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_SECONDS)

    async def _run_once(self, env: dict[str, str], stop: asyncio.Event, console: Console) -> int:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "holdfast", self.service,
            env=env if self.metrics_port is None else {
                **env, "HOLDFAST_METRICS_PORT": str(self.metrics_port)
            },
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            # Its own session: a Ctrl-C in the terminal reaches only the
            # supervisor, which then stops the services one signal each.
            start_new_session=True,
            limit=1 << 20,
        )  # fmt: skip
        assert process.stdout is not None
        output = asyncio.create_task(self._relay(process.stdout, console))
        try:
            await _first_of(process.wait(), stop.wait())
            if process.returncode is None:
                await self._terminate(process)
            assert process.returncode is not None
            return process.returncode
        finally:
            if process.returncode is None:  # we are being cancelled
                process.kill()
                await process.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(output, 5)

    async def _terminate(self, process: asyncio.subprocess.Process) -> None:
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), STOP_GRACE_SECONDS)
        except TimeoutError:
            log.warning("%s did not stop within %.0f s; killing it", self.name, STOP_GRACE_SECONDS)
            process.kill()
            await process.wait()

    async def _relay(self, stream: asyncio.StreamReader, console: Console) -> None:
        """Copy the service's output to ours, each line prefixed with its name."""
        prefix = Text(f"{self.name:>13} │ ", style=self.style)
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # longer than the limit; readline dropped it
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            console.print(prefix + Text(text), soft_wrap=True, highlight=False)


async def _first_of(*awaitables: Awaitable[Any]) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def _ensure_api_key(
    database_url: str, configured_key: str | None, key_file: Path
) -> tuple[str | None, str]:
    """Make sure the database holds an API key; return (key if new, where to find it)."""
    engine = create_engine(database_url, pool_size=1)
    try:
        async with session_factory(engine)() as session, session.begin():
            if configured_key:
                await add_key(session, DEFAULT_TENANT, configured_key, name="HOLDFAST_API_KEY")
                return None, "from HOLDFAST_API_KEY"
            if await has_any_key(session):
                if await asyncio.to_thread(key_file.exists):
                    return None, f"in {key_file}"
                return None, "created earlier (`holdfast keys create` makes another)"
            key = generate_key()
            # Written before the commit: if the commit fails, the next start
            # finds no key in the database and overwrites this file.
            await asyncio.to_thread(_write_secret, key_file, key)
            await add_key(session, DEFAULT_TENANT, key, name="holdfast up")
            return key, f"in {key_file}"
    finally:
        await engine.dispose()


def _asset_key(settings: Settings, key_file: Path) -> str:
    """``HOLDFAST_ASSET_ENCRYPTION_KEY`` if set, else the one kept in ``key_file``
    (made on the first start, mode 0600): the services of this data directory
    must always open the credentials they sealed before."""
    if settings.asset_encryption_key is not None:
        return settings.asset_encryption_key.get_secret_value()
    if key_file.exists():
        return key_file.read_text().strip()
    key = Vault.generate_key()
    _write_secret(key_file, key)
    return key


def _write_secret(path: Path, secret: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    # O_CREAT's mode only applies to a new file; an old one may be wider.
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secret + "\n")


def _lock(path: Path) -> IO[str] | None:
    """An exclusive lock held while the returned file stays open; the kernel drops it on exit."""
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def _announce_key(console: Console, key: str, key_file: Path) -> None:
    """Show a new key on the terminal; output that is not one (a log) gets only where it is."""
    if console.is_terminal:
        body = Text.assemble(
            'A new API key for tenant "default". It is shown only this once; it is also\n',
            f"saved to {key_file} (readable only by you). The database keeps only its hash.\n",
            "Send it in the X-Engine-Key header.\n\n",
            (key, "bold"),
        )
    else:
        body = Text(
            f'A new API key for tenant "default" is in {key_file} (readable only by you);\n'
            "it is not printed here, as this output is not a terminal. The database keeps\n"
            "only its hash. Send it in the X-Engine-Key header."
        )
    console.print(Panel(body, title="API key", border_style="bold yellow", expand=False))


def _banner(
    settings: Settings,
    *,
    data_dir: Path,
    redis: tuple[str, str],
    postgres: tuple[str, str],
    key_where: str,
    children: list[_Child],
) -> Panel:
    workers = sum(child.service == "loop-worker" for child in children)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("gateway", f"http://{settings.host}:{settings.port}")
    grid.add_row("console", f"http://{settings.host}:{settings.port}/console")
    grid.add_row("API key", key_where)
    grid.add_row("model", default_model(settings.model, os.environ).describe())
    grid.add_row("Redis", f"{redis[0]}  {_hide_password(redis[1])}")
    grid.add_row("PostgreSQL", f"{postgres[0]}  {_hide_password(postgres[1])}")
    grid.add_row("data", str(data_dir))
    grid.add_row("metrics", _metrics_where(settings, children))
    grid.add_row(
        "services",
        f"gateway, {workers} loop-worker{'s' if workers > 1 else ''}, tool-runner, learning",
    )
    return Panel(
        grid, title="Holdfast is up", subtitle="Ctrl-C to stop", border_style="green", expand=False
    )


def _metrics_where(settings: Settings, children: list[_Child]) -> str:
    lines = [f"http://{settings.host}:{settings.port}/metrics (gateway)"]
    lines += [
        f"http://{settings.host}:{child.metrics_port}/metrics ({child.name})"
        for child in children
        if child.metrics_port is not None
    ]
    return "\n".join(lines)


def _hide_password(url: str) -> str:
    return re.sub(r"(//[^/@:]*:)[^/@]*@", r"\1***@", url)
