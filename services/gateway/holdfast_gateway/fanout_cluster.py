"""The gateway's tailer on a Redis Cluster: one blocking ``XREAD`` per hash slot.

A cluster refuses a command whose keys are in several slots (``CROSSSLOT``),
even on one node, so the single ``XREAD`` of :class:`~holdfast_gateway.fanout.Hub`
over every followed task's stream cannot be sent there. :class:`ClusterHub`
keeps the design — one tailer per gateway process owning every cursor, one read
serving all the subscribers of the streams it covers — and splits that read by
slot: the tailer (``run``) keeps one reader per slot that has followed tasks,
each blocking on the streams of its slot plus a wake stream of its own in that
slot (tagged with the task that opened it), so a task newly followed in a slot
already being read is picked up at once. Slots hold tasks by the hash of their
id, so a gateway following N tasks holds about N blocking connections, spread
over the masters as the tasks are.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, NoReturn, cast

from holdfast_shared.redisconn import ClusterClient
from redis.typing import KeyT, StreamIdT

from holdfast_gateway.fanout import _BLOCK_MS, _READ_COUNT, Hub

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _SlotReader:
    slot: int
    wake_key: str
    streams: set[str] = field(default_factory=set)
    wake_cursor: str = "0-0"


class ClusterHub(Hub):
    """A :class:`Hub` whose reads are split per hash slot (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._readers: dict[int, _SlotReader] = {}
        self._serial = itertools.count()
        self._to_start: asyncio.Queue[_SlotReader] = asyncio.Queue()

    @property
    def _cluster(self) -> ClusterClient:
        return cast(ClusterClient, self.redis)

    async def _follow(self, task_id: str) -> None:
        key = self.keys.events(task_id)
        slot = self._cluster.keyslot(key)
        reader = self._readers.get(slot)
        if reader is None:
            # The wake stream's hash tag is the task's: it lives in the task's slot.
            wake = f"{self.keys.gateway_wake(self.gateway_id)}:{next(self._serial)}:{{{task_id}}}"
            reader = self._readers[slot] = _SlotReader(slot, wake, {key})
            self._to_start.put_nowait(reader)
            return
        reader.streams.add(key)
        await self.redis.xadd(reader.wake_key, {"t": task_id}, maxlen=100)

    async def run(self) -> NoReturn:
        """Start a reader for each slot that gets followed tasks, for ever; cancelling
        this cancels them all."""
        readers: set[asyncio.Task[None]] = set()
        try:
            while True:
                reader = await self._to_start.get()
                task = asyncio.create_task(
                    self._read_slot(reader), name=f"tailer slot {reader.slot}"
                )
                readers.add(task)
                task.add_done_callback(readers.discard)
        finally:
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def _read_slot(self, reader: _SlotReader) -> None:
        try:
            while True:
                streams: dict[KeyT, StreamIdT] = {reader.wake_key: reader.wake_cursor}
                for key in list(reader.streams):
                    task_id = self._key_to_task.get(key)
                    tail = self._tails.get(task_id) if task_id else None
                    if tail is None:
                        reader.streams.discard(key)  # its last subscriber left
                    else:
                        streams[key] = f"{tail.cursor}-0"
                if not reader.streams:
                    # No await between this check and leaving the map: a task followed
                    # from now on in this slot gets a new reader.
                    if self._readers.get(reader.slot) is reader:
                        del self._readers[reader.slot]
                    return
                try:
                    response = await self.redis.xread(streams, count=_READ_COUNT, block=_BLOCK_MS)
                except Exception:
                    log.exception("event tailer read of slot %d failed; retrying", reader.slot)
                    await asyncio.sleep(0.5)
                    continue
                for key, entries in response or []:
                    if key == reader.wake_key:
                        reader.wake_cursor = entries[-1][0]
                    else:
                        self._dispatch(key, entries)
        finally:
            try:
                await self.redis.delete(reader.wake_key)
            except Exception:
                log.debug("could not delete %s", reader.wake_key, exc_info=True)

    async def close(self) -> None:
        await super().close()
        for reader in list(self._readers.values()):
            await self.redis.delete(reader.wake_key)
