"""A service's background loops: one owner, one way to run them, one way to stop them.

Every service process has duties that run beside its main loop for as long
as it lives: tailing event logs, archiving them, renewing leases, listening
for cancels, announcing itself, sweeping. They all run in one
:class:`Background` — a ``TaskGroup`` — started inside its ``async with``
block and cancelled and awaited together when the block ends, whether it
ends normally, by an error or by a cancel.

A loop handles the failures it expects (Redis restarting, PostgreSQL
briefly gone) and goes on; :func:`every` is that shape for periodic duties.
A loop that fails otherwise is a bug: the group then cancels the whole block
and re-raises, so a process never keeps running with one of its duties dead
(a worker that no longer renews its leases would see its turns taken over
while it still runs them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, NoReturn, Self

log = logging.getLogger(__name__)


# How long a cancelled task may take to end before it is cancelled again. On
# CPython 3.11 ``asyncio.wait_for`` drops a cancel that lands in the tick its
# inner future completes (python/cpython#86296, #107547; rewritten in 3.12), and
# redis-py sends every command through it: a loop cancelled at that moment goes
# on, and the process never stops (seen in the learning service's trajectory
# intake, stopped during a Redis Cluster failover). A loop's own clean-up on
# cancel (a last write) takes well under this.
RECANCEL_SECONDS = 2.0


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (if any) and wait until it has really stopped, cancelling
    it again while a lost cancel leaves it running (``RECANCEL_SECONDS``)."""
    if task is None:
        return
    await _cancelled([task])
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _cancelled(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` until every one has ended."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=RECANCEL_SECONDS)


async def every(
    seconds: float,
    step: Callable[[], Awaitable[object]],
    *,
    what: str,
    wait_first: bool = False,
) -> NoReturn:
    """Run ``step`` every ``seconds`` for ever; a step that fails is logged
    (``what`` names it) and the next one runs on time."""
    if wait_first:
        await asyncio.sleep(seconds)
    while True:
        try:
            await step()
        except Exception:
            log.warning("%s failed; trying again in %gs", what, seconds, exc_info=True)
        await asyncio.sleep(seconds)


class Background:
    """The background loops of one process, in one ``TaskGroup``.

    ::

        async with Background() as background:
            background.start(archiver.run(), name="archiver")
            await consumer.run(stop)
        # every loop is cancelled and has stopped here
    """

    def __init__(self) -> None:
        self._group = asyncio.TaskGroup()
        self._tasks: list[asyncio.Task[Any]] = []

    async def __aenter__(self) -> Self:
        await self._group.__aenter__()
        return self

    def start(self, loop: Coroutine[Any, Any, Any], *, name: str) -> None:
        """Run ``loop`` until the block ends."""
        self._tasks.append(self._group.create_task(loop, name=name))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        ending = asyncio.create_task(_cancelled(self._tasks))
        try:
            await self._group.__aexit__(exc_type, exc, tb)
        finally:
            await cancel_and_wait(ending)
