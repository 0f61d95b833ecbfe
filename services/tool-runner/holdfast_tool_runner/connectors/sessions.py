"""MCP client sessions kept open across the calls of a task.

A session costs a connection and a handshake (for a stdio server, a sandboxed
process and its start-up), so a runner keeps one per (tenant, task, server) and
reuses it for every call of the task that reaches this runner. Who closes one:

* for a stdio server (a process in the task's sandbox), the task's pause or
  park or any stop other than a turn's normal end (the runner's reap request:
  :meth:`Sessions.close_task`), since the reaper kills what runs in the task's
  sandbox then (a paused task's server must not go on changing its workspace
  while it is checkpointed). A turn's normal end keeps it, so the task's next
  turns call on it without a new start (0.8-4 s for a node or Python server);
* the task's deletion (:meth:`Sessions.close_task` with ``only_local=False``);
* idleness, ``HOLDFAST_ASSET_SESSION_IDLE_SECONDS`` without a call, or
  ``HOLDFAST_ASSET_STDIO_IDLE_SECONDS`` for a stdio server's (:meth:`sweep`);
* a failure: a call that times out or finds the transport gone closes its session,
  and the next call opens a new one;
* a changed registration (another ``version`` of the server), and the runner
  stopping (:meth:`aclose`).

Each session lives in a task of its own (:class:`_Held`) that enters the SDK's
``Client`` context and leaves it: the SDK's transports run anyio task groups,
which must be exited by the task that entered them. Calls are made from the
callers' tasks through the connected client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from mcp import Client

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionKey:
    tenant_id: str
    task_id: str
    server: str


Opener = Callable[[], AbstractAsyncContextManager[Client]]


class _Held:
    """One session, opened and closed by its own task."""

    def __init__(self, key: SessionKey, version: str, opener: Opener, *, local: bool) -> None:
        self.key = key
        self.version = version
        self.local = local
        self.last_used = time.monotonic()
        self._opener = opener
        self._ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self.task = asyncio.create_task(self._hold(), name=f"mcp-session:{key.server}")

    async def _hold(self) -> None:
        try:
            async with self._opener() as client:
                self._ready.set_result(client)
                await self._closing.wait()
        except BaseException as exc:
            if not self._ready.done():
                self._ready.set_exception(exc)
            elif not isinstance(exc, asyncio.CancelledError | Exception):
                raise
            # A session that broke after it opened: its calls already failed.

    async def client(self) -> Client:
        return await asyncio.shield(self._ready)

    @property
    def alive(self) -> bool:
        return not self.task.done() and not self._closing.is_set()

    async def close(self, grace: float = 5.0) -> None:
        self._closing.set()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace)
        except (TimeoutError, asyncio.CancelledError):
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        except BaseException:
            pass  # it failed closing: it is closed all the same


class Sessions:
    """The open sessions of this runner, by (tenant, task, server)."""

    def __init__(self, *, idle_seconds: float, local_idle_seconds: float | None = None) -> None:
        self.idle_seconds = idle_seconds
        self.local_idle_seconds = idle_seconds if local_idle_seconds is None else local_idle_seconds
        self._held: dict[SessionKey, _Held] = {}
        self._locks: dict[SessionKey, asyncio.Lock] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return key in self._held

    async def client(
        self, key: SessionKey, version: str, opener: Opener, *, local: bool = False
    ) -> Client:
        """The task's connected session to the server, opened with ``opener`` if it
        has none (or one of another ``version`` of the server's registration).
        ``local``: the server runs in the task's sandbox (stdio), so the session
        ends when the task stops. Raises what opening raised."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            held = self._held.get(key)
            if held is not None and (not held.alive or held.version != version):
                await self._drop(key)
                held = None
            if held is None:
                held = _Held(key, version, opener, local=local)
                self._held[key] = held
            held.last_used = time.monotonic()
            try:
                return await held.client()
            except BaseException:
                await self._drop(key)
                raise

    def touch(self, key: SessionKey) -> None:
        held = self._held.get(key)
        if held is not None:
            held.last_used = time.monotonic()

    async def discard(self, key: SessionKey) -> None:
        """Close the session of ``key`` (a call found it broken, or timed out)."""
        await self._drop(key)

    async def _drop(self, key: SessionKey) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            await held.close()

    async def close_task(self, tenant_id: str, task_id: str, *, only_local: bool = True) -> int:
        """Close the task's sessions: its stdio servers' (``only_local``: it
        stopped, and the reaper ends their processes), else all of them (it was
        deleted); how many."""
        keys = [
            k
            for k, held in self._held.items()
            if k.tenant_id == tenant_id and k.task_id == task_id and (held.local or not only_local)
        ]
        await asyncio.gather(*(self._drop(key) for key in keys))
        for key in keys:
            self._locks.pop(key, None)
        return len(keys)

    def local(self, tenant_id: str, task_id: str) -> list[SessionKey]:
        """The task's open sessions to stdio servers."""
        return [
            k
            for k, held in self._held.items()
            if k.tenant_id == tenant_id and k.task_id == task_id and held.local and held.alive
        ]

    async def sweep(self) -> int:
        """Close the sessions idle past their idle time; how many."""
        now = time.monotonic()
        idle = [
            k
            for k, h in self._held.items()
            if now - h.last_used > (self.local_idle_seconds if h.local else self.idle_seconds)
        ]
        await asyncio.gather(*(self._drop(key) for key in idle))
        return len(idle)

    async def aclose(self) -> None:
        await asyncio.gather(*(self._drop(key) for key in list(self._held)))
