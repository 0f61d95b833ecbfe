"""A running MCP call's progress, relayed to the loop-worker waiting for the call.

A server sends ``notifications/progress`` for a request that carries a progress
token (the SDK's ``progress_callback`` asks for them); each becomes an
:class:`~holdfast_shared.jobs.InboxMessage` of kind ``tool_progress`` on the
call's ``reply_to``, ahead of its ``tool_result``, and the loop-worker emits it
as a ``tool_progress`` event. At most one every :data:`MIN_INTERVAL_SECONDS`
(a server may report per item of a long loop), but a report that reaches its
total always goes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from holdfast_shared.jobs import InboxMessage, ToolCallJob, ToolCallProgress
from redis.asyncio import Redis

log = logging.getLogger(__name__)

MIN_INTERVAL_SECONDS = 0.2
# What a server's progress message may carry into the event log.
_MAX_MESSAGE_CHARS = 1000

# What the connectors call with each report, redacted of the server's secrets.
ProgressSink = Callable[[ToolCallProgress], Awaitable[None]]


class ProgressRelay:
    """Sends ``job``'s progress reports to ``job.reply_to`` (see the module docstring)."""

    def __init__(self, redis: Redis, job: ToolCallJob) -> None:
        self.redis = redis
        self.job = job
        self._last = float("-inf")

    async def __call__(self, report: ToolCallProgress) -> None:
        now = time.monotonic()
        final = report.total is not None and report.progress >= report.total
        if not final and now - self._last < MIN_INTERVAL_SECONDS:
            return
        self._last = now
        if report.message is not None and len(report.message) > _MAX_MESSAGE_CHARS:
            report = report.model_copy(update={"message": report.message[:_MAX_MESSAGE_CHARS]})
        message = InboxMessage(
            kind="tool_progress",
            correlation_id=f"{self.job.task_id}:{self.job.tool_call_id}",
            payload=report.model_dump(),
        )
        try:
            await self.redis.xadd(self.job.reply_to, message.to_fields(), maxlen=10_000)
        except Exception:
            # Progress is a courtesy: the call goes on without it.
            log.warning("could not relay the progress of call %s", self.job.tool_call_id)
