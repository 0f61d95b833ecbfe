"""Per-turn event emitter: coalesces events into as few log appends as possible.

``emit`` never waits for Redis while a write is already in flight: events
queue up and go out together in the next append, so a fast model stream costs
one round trip per batch instead of one per delta, and the first event of a
quiet stream still leaves at once.
"""

from __future__ import annotations

import asyncio

from holdfast_shared.eventlog import EventLog
from holdfast_shared.events import _Event, body_json

# Past this many queued events, emit() waits for the writer (backpressure).
_HIGH_WATER = 2000


class Emitter:
    def __init__(self, log: EventLog, task_id: str, turn_id: str) -> None:
        self._log = log
        # Set when the turn is claimed; appends of a superseded epoch are refused.
        self.epoch: int | None = None
        # The client's name for the task, which its events carry; set with the
        # epoch, from the task's row.
        self.task_name = task_id
        self._task_id = task_id
        self._turn_id = turn_id
        self._pending: list[tuple[str, str]] = []
        self._writer: asyncio.Task[None] | None = None
        self.last_seq = 0

    async def emit(self, event: _Event) -> None:
        await self.emit_body(event.type, body_json(event))

    async def emit_body(self, event_type: str, body: str) -> None:
        """Emit an event already serialised (``body_json``'s form: no envelope)."""
        self._pending.append((event_type, body))
        if self._writer is None or self._writer.done():
            if self._writer is not None:
                self._writer.result()  # surface a failed write now
            self._writer = asyncio.create_task(self._write(), name=f"emit:{self._task_id}")
        elif len(self._pending) >= _HIGH_WATER:
            await asyncio.shield(self._writer)

    async def drain(self) -> int:
        """Wait until every emitted event is in the log; returns the last seq."""
        while self._writer is not None:
            writer = self._writer
            await writer
            if self._writer is writer:
                self._writer = None
        return self.last_seq

    async def finish(self, events: list[_Event]) -> int:
        """Append the turn's last events and free the task in one atomic step."""
        await self.drain()
        bodies = [(event.type, body_json(event)) for event in events]
        appended = await self._log.append_bodies(
            self._task_id,
            self._turn_id,
            bodies,
            name=self.task_name,
            release_lock=True,
            epoch=self.epoch,
        )
        self.last_seq = appended.last_seq
        return self.last_seq

    async def _write(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            appended = await self._log.append_bodies(
                self._task_id, self._turn_id, batch, name=self.task_name, epoch=self.epoch
            )
            self.last_seq = appended.last_seq
