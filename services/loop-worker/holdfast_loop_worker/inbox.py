"""A loop-worker's inbox: replies to its turns, delivered to whoever awaits them.

Tool-runners and the gateway answer a waiting turn by appending an
:class:`~holdfast_shared.jobs.InboxMessage` to ``Keys.worker_inbox``; one
reader per process resolves the future registered under the message's
correlation id. Register with :meth:`expect` *before* sending the request, so
a fast reply cannot arrive unheard. A running call's progress reports
(``tool_progress``) and its server's requests (``tool_elicitation``, a
question to the user; ``tool_sampling``, a model call) come the same way
before its reply, in order, to the queue :meth:`progress` gave for its
correlation id (dropped if nobody listens: the runner gives up on an
unanswered request when its wait passes).
"""

from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

from holdfast_shared.jobs import InboxMessage
from holdfast_shared.keys import Keys
from redis.asyncio import Redis

log = logging.getLogger(__name__)

# Progress reports of one call not read yet, at most (the runner sends a few a second).
_PROGRESS_QUEUE = 64


class Inbox:
    def __init__(self, redis: Redis, keys: Keys, worker_id: str) -> None:
        self.redis = redis
        self.stream = keys.worker_inbox(worker_id)
        self._waiting: dict[str, asyncio.Future[InboxMessage]] = {}
        self._progress: dict[str, asyncio.Queue[InboxMessage]] = {}

    async def close(self) -> None:
        """After :meth:`run` stopped: nobody reads this inbox any more."""
        await self.redis.delete(self.stream)

    def expect(self, correlation_id: str) -> asyncio.Future[InboxMessage]:
        future: asyncio.Future[InboxMessage] = asyncio.get_running_loop().create_future()
        self._waiting[correlation_id] = future
        return future

    def progress(self, correlation_id: str) -> asyncio.Queue[InboxMessage]:
        """Where the progress reports of ``correlation_id`` go until :meth:`forget`."""
        queue = self._progress[correlation_id] = asyncio.Queue(maxsize=_PROGRESS_QUEUE)
        return queue

    def forget(self, correlation_id: str) -> None:
        self._waiting.pop(correlation_id, None)
        self._progress.pop(correlation_id, None)

    async def run(self) -> NoReturn:
        """Deliver replies to their waiters, for ever (run it in a ``Background``)."""
        cursor = "0-0"
        while True:
            try:
                response = await self.redis.xread({self.stream: cursor}, count=100, block=5000)
            except Exception:
                log.exception("inbox read failed; retrying")
                await asyncio.sleep(0.5)
                continue
            for _key, entries in response or []:
                for entry_id, fields in entries:
                    cursor = entry_id
                    self._deliver(fields)
                await self.redis.xtrim(self.stream, minid=cursor)

    def _deliver(self, fields: dict[str, str]) -> None:
        try:
            message = InboxMessage.from_fields(fields)
        except ValueError:
            log.error("dropping malformed inbox entry %r", fields)
            return
        if message.kind in ("tool_progress", "tool_elicitation", "tool_sampling"):
            queue = self._progress.get(message.correlation_id)
            if queue is not None and not queue.full():
                queue.put_nowait(message)  # a full queue: its reader is behind, skip one
            return
        future = self._waiting.pop(message.correlation_id, None)
        if future is not None and not future.done():
            future.set_result(message)
