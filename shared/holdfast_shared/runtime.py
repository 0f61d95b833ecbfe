"""How a service process runs its main coroutine: on uvloop, as uvicorn runs the gateway.

uvloop's event loop, its transports and its protocol parsing are C: a loop-worker
spends a large share of its CPU in the event loop itself (every Redis and
PostgreSQL round trip is a socket write, a wake-up and a read), and that share
is what uvloop takes off (docs/performance.md). Where uvloop is not installed
(it has no Windows build), or ``HOLDFAST_EVENT_LOOP=asyncio`` asks for it, the
standard loop runs.
"""

from __future__ import annotations

import asyncio
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
