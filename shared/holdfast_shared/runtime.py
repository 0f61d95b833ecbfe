"""How a service process runs its main coroutine: on uvloop, as uvicorn runs the gateway,
with the heap it started with kept out of the garbage collector's full passes.

uvloop's event loop, its transports and its protocol parsing are C: a loop-worker
spends a large share of its CPU in the event loop itself (every Redis and
PostgreSQL round trip is a socket write, a wake-up and a read), and that share
is what uvloop takes off (docs/performance.md). Where uvloop is not installed
(it has no Windows build), or ``HOLDFAST_EVENT_LOOP=asyncio`` asks for it, the
standard loop runs.

:func:`settle_heap`: a service imports a few thousand modules (SQLAlchemy,
pydantic, the provider SDKs) before it serves anything, and CPython's full
(generation 2) collection walks every one of those objects each time it runs.
In a loop-worker streaming 250 turns that was 12 pauses of 260 to 455 ms in a
10 s window, each stalling every turn of the process at once (the capacity
row's p99). Frozen (``gc.freeze``), the start-up objects are never scanned
again: a full pass walks only what the service allocated since.

The start-up the stream consumers (loop-worker, tool-runner) share:
:func:`process_name` names the process in its consumer group and liveness key,
:func:`stop_on_signals` turns SIGTERM/SIGINT into the stop event their consumer
loop watches, and :class:`Presence` says the process lives (announced and
beating) from before it reads its first entry until it withdraws.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Literal, TypeVar

from redis.exceptions import RedisError

from holdfast_shared.background import Background, every
from holdfast_shared.liveness import Heartbeat, refresh_every

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], event_loop: Literal["auto", "asyncio"] = "auto") -> T:
    """``asyncio.run(main)``, on uvloop unless ``event_loop`` says otherwise or it
    is not installed."""
    if event_loop == "auto":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    return asyncio.run(main)


def settle_heap() -> None:
    """Move every object alive now out of the collector's reach (``gc.freeze``): call
    it once the process has imported what it serves with, before it serves.

    A collection first, so that start-up garbage is freed instead of frozen.
    Cycles made of frozen objects are never collected: nothing the service
    allocates afterwards is frozen, so only start-up state (modules, classes,
    settings) stays for good, which it would anyway.
    """
    gc.collect()
    gc.freeze()


def process_name() -> str:
    """This process's name in its consumer group and liveness key: unique per host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


def stop_on_signals(stop: asyncio.Event | None = None) -> asyncio.Event:
    """``stop`` (a new event when None), set on SIGTERM or SIGINT: the service's
    consumer loop ends on it and drains. Call it from the running event loop."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    return stop


class Presence:
    """A consumer process's liveness: announced (``announce``) and beating (the
    ``heartbeat`` thread) before it reads its first entry, re-announced every
    refresh while it lives, withdrawn when it stops.

    Others take over the entries of a consumer without a liveness key
    (``liveness``), so :meth:`start` comes before the consumer's first read; the
    announcing loop runs in the service's :class:`Background`, which cancels it,
    and :meth:`stop` comes after that block has ended, so nothing announces the
    process again once it has withdrawn.
    """

    def __init__(
        self,
        heartbeat: Heartbeat,
        announce: Callable[[], Awaitable[None]],
        withdraw: Callable[[], Awaitable[None]],
        *,
        liveness_seconds: float,
        what: str,
    ) -> None:
        self.heartbeat = heartbeat
        self.announce = announce
        self.withdraw = withdraw
        self.liveness_seconds = liveness_seconds
        self.what = what

    async def start(self, background: Background) -> None:
        """Announce now and start beating, then re-announce from ``background``."""
        with contextlib.suppress(RedisError):  # unreachable: the consumer's reads retry
            await self.announce()
        # Beats through event-loop stalls: only a dead (or stopped) process lapses.
        self.heartbeat.start()
        background.start(
            every(
                refresh_every(self.liveness_seconds),
                self.announce,
                what=self.what,
                wait_first=True,
            ),
            name="announce",
        )

    async def stop(self) -> None:
        """Stop beating and withdraw: what the process left pending is free at once."""
        await asyncio.to_thread(self.heartbeat.stop)
        with contextlib.suppress(RedisError):  # Redis gone: the key lapses on its own
            await self.withdraw()
