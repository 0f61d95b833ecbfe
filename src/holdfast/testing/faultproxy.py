"""A TCP proxy that misbehaves on demand, between the engine and a server it uses.

Toxiproxy's role, in process: put a :class:`FaultProxy` in front of PostgreSQL,
Redis, an MCP server or a model provider, hand the engine the proxy's address
(:meth:`FaultProxy.url_for`), and change how the network behaves while the
engine runs::

    with FaultProxy("127.0.0.1", 5432) as pg:
        env = {"HOLDFAST_DATABASE_URL": pg.url_for(database_url)}
        ...
        pg.set(latency_ms=200)       # every chunk, both ways, 200 ms late
        pg.set(bytes_per_second=4096)
        pg.reset_all()               # every open connection cut with a TCP RST
        pg.set(reset_after=(100, 5000))  # new connections cut at a random byte offset
        pg.set(blackhole=True)       # accepted, never answered, nothing forwarded
        pg.heal()                    # back to a plain proxy

The proxy runs its own event loop on a daemon thread, so a synchronous test,
an asyncio test and the engine's processes all see the same faults; the
settings are plain attributes read by every chunk, so a change applies to the
connections already open too (a blackhole stalls them mid-stream).
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

_CHUNK = 65536


@dataclass(frozen=True)
class Faults:
    """How the proxy behaves now; :meth:`FaultProxy.set` replaces fields."""

    # Each chunk is held this long before it is passed on (both directions).
    latency_ms: float = 0.0
    # At most this many bytes a second per direction of each connection (0: unlimited).
    bytes_per_second: int = 0
    # New connections are cut (RST) after a random number of bytes in this range,
    # counted over both directions; None: never.
    reset_after: tuple[int, int] | None = None
    # Accept, forward nothing either way, answer nothing: a partition that a
    # client notices only through its own timeouts.
    blackhole: bool = False
    # Refuse new connections (closed at once with an RST), as a stopped server does.
    refuse: bool = False


class FaultProxy:
    """A proxy to ``host:port`` listening on ``127.0.0.1:<listen_port>`` (a free one by default)."""

    def __init__(self, host: str, port: int, *, listen_port: int = 0) -> None:
        self.upstream = (host, port)
        self.faults = Faults()
        self._listen_port = listen_port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._open: set[_Connection] = set()
        self._healed = asyncio.Event()
        # Counters a test can assert on.
        self.accepted = 0
        self.cut = 0

    # -- life -----------------------------------------------------------------------
    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(timeout=10)
        return self

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the proxy first"
        return int(self._server.sockets[0].getsockname()[1])

    def url_for(self, url: str) -> str:
        """``url`` (redis://, postgresql://, http://, …) with its host and port
        replaced by the proxy's: the same server, through the proxy."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    # -- faults ---------------------------------------------------------------------
    def set(self, **changes: Any) -> None:
        """Change the faults (fields of :class:`Faults`); the rest stay as they are."""
        faults = replace(self.faults, **changes)
        self._loop.call_soon_threadsafe(self._apply, faults)

    def heal(self) -> None:
        """A plain proxy again; connections stalled by a blackhole go on."""
        self._loop.call_soon_threadsafe(self._apply, Faults())

    def reset_all(self) -> int:
        """Cut every open connection with an RST; how many there were."""
        future = asyncio.run_coroutine_threadsafe(self._reset_all(), self._loop)
        return future.result(timeout=10)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    # -- inside the proxy's loop --------------------------------------------------------
    def _apply(self, faults: Faults) -> None:
        self.faults = faults
        if faults.blackhole:
            self._healed.clear()
        else:
            self._healed.set()

    async def _listen(self) -> None:
        self._healed.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self._listen_port)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._reset_all()

    async def _reset_all(self) -> int:
        connections = list(self._open)
        for connection in connections:
            connection.reset()
        return len(connections)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        faults = self.faults
        if faults.refuse:
            _abort(writer)
            return
        # A blackholed proxy takes the connection and says nothing, not even
        # to the server: the client's own timeouts are all it has.
        await self._healed.wait()
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            _abort(writer)
            return
        budget = random.randint(*faults.reset_after) if faults.reset_after else None
        connection = _Connection(self, writer, up_writer, budget)
        self._open.add(connection)
        try:
            await asyncio.gather(
                connection.pump(reader, up_writer), connection.pump(up_reader, writer)
            )
        finally:
            self._open.discard(connection)
            connection.reset()


class _Connection:
    """One client connection and its upstream one, pumped both ways under the faults."""

    def __init__(
        self,
        proxy: FaultProxy,
        client: asyncio.StreamWriter,
        upstream: asyncio.StreamWriter,
        budget: int | None,
    ) -> None:
        self.proxy = proxy
        self.writers = (client, upstream)
        self.budget = budget
        self.closed = False

    async def pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        proxy = self.proxy
        try:
            while not self.closed:
                chunk = await source.read(_CHUNK)
                if not chunk:
                    # One side finished: the other is told the same way, not cut.
                    if sink.can_write_eof():
                        sink.write_eof()
                    return
                await proxy._healed.wait()
                faults = proxy.faults
                if faults.latency_ms:
                    await asyncio.sleep(faults.latency_ms / 1000)
                if faults.bytes_per_second:
                    await asyncio.sleep(len(chunk) / faults.bytes_per_second)
                if self.budget is not None:
                    if len(chunk) >= self.budget:
                        sink.write(chunk[: self.budget])
                        self.proxy.cut += 1
                        self.reset()
                        return
                    self.budget -= len(chunk)
                if self.closed:
                    return
                sink.write(chunk)
                await sink.drain()
        except (ConnectionError, OSError):
            self.reset()

    def reset(self) -> None:
        if self.closed:
            return
        self.closed = True
        for writer in self.writers:
            _abort(writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN: the peer sees a connection reset,
    as when a host or a middlebox drops it."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()
