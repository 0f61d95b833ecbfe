"""Who stops a running turn from outside, and how the turn takes its own stops.

A turn runs as one asyncio task. Two parties stop it from outside, both in
the consumer, both through :meth:`TurnStop.request`:

* the cancel listener, for ``POST /execute/cancel`` — reason ``cancel``: the
  turn ends ``completed`` with ``stop_reason: "cancelled"``;
* the drain at shutdown, for a turn still running when the drain time is
  up — reason ``handoff``: the turn is snapshotted and queued for another
  worker;
* the pause listener, for ``POST /v1/execution/{id}/pause`` while the turn
  streams a model call — reason ``pause``: the call is cut off and the turn
  parks paused (``executions.py``); it runs again on resume.

Each request cancels the task once and is counted. When the turn sees
``CancelledError`` it calls :meth:`TurnStop.consume`, which takes back
(``uncancel``) exactly the cancellations it requested — and only when they
are all the task has pending. Any other cancellation (the worker's own
shutdown, a test, an enclosing scope) is not ours: ``consume`` returns None,
the turn re-raises, and the outside cancel wins. ``asyncio.timeout`` keeps
its own count the same way, so a deadline and a stop never mistake each
other.

When both reasons were requested, ``cancel`` wins: the user asked for the
turn to stop, and a hand-back would only run it again elsewhere.

A request not taken within ``RECANCEL_SECONDS`` is sent again: on CPython
3.11 ``asyncio.wait_for`` drops a cancel that lands in the tick its inner
future completes (python/cpython#86296), and every Redis command goes
through one (redis-py). A turn that lost its stop streamed on: a delete
answered 409 after waiting 8 s for it, a Ctrl-C's hand-back waited out the
services' 10 s grace.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from holdfast_shared.background import RECANCEL_SECONDS

StopReason = Literal["cancel", "handoff", "pause"]


class TurnStop:
    """The stop requests for one turn's task."""

    def __init__(self) -> None:
        self.reason: StopReason | None = None
        self._task: asyncio.Task[Any] | None = None
        self._requested = 0
        # Set once the turn took its stop: it is ending, and a later request
        # (a second cancel, say two interrupts racing) must not cut that short.
        self._stopping = False
        self._again: asyncio.TimerHandle | None = None

    def bind(self, task: asyncio.Task[Any]) -> None:
        """The task that runs the turn: the one :meth:`request` cancels."""
        self._task = task

    def request(self, reason: StopReason) -> bool:
        """Stop the turn for ``reason``; False when it is not running (any more)."""
        task = self._task
        if task is None or task.done():
            return False
        if self._stopping:
            return True
        if self.reason != "cancel":
            self.reason = reason
        self._cancel(task)
        return True

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        self._requested += 1
        task.cancel()
        if self._again is None:
            loop = asyncio.get_running_loop()
            self._again = loop.call_later(RECANCEL_SECONDS, self._send_again)

    def _send_again(self) -> None:
        """The turn has not taken its stop yet: its cancel may have been lost."""
        self._again = None
        task = self._task
        if task is not None and not task.done() and not self._stopping and self._requested:
            self._cancel(task)

    def consume(self) -> StopReason | None:
        """From the turn's ``except CancelledError``: the reason the turn was
        stopped for when every pending cancellation is one of ours (they are
        taken back, so the turn can end properly); None when someone else
        cancelled too, and the caller must re-raise."""
        task = asyncio.current_task()
        if task is None or task is not self._task or self._requested == 0:
            return None
        if task.cancelling() > self._requested:
            return None
        for _ in range(self._requested):
            task.uncancel()
        self._requested = 0
        self._stopping = True
        if self._again is not None:
            self._again.cancel()
            self._again = None
        return self.reason
