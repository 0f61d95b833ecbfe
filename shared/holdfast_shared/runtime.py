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
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

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
