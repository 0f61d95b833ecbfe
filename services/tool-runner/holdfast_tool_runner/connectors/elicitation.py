"""A running MCP call's server asks the user something (``elicitation/create``).

The runner cannot ask anyone itself: the question goes to the turn waiting for
the call, as an :class:`~holdfast_shared.jobs.InboxMessage` of kind
``tool_elicitation`` on the call's ``reply_to``. The turn opens a
``hitl_request`` of kind ``elicitation``, and the person's answer (``POST
/hitl/respond``, checked against the requested schema there) comes back on a
Redis list of this question's own, which the relay pops. The call stays live
meanwhile, so the wait is bounded by what is left of the call's timeout (less
a margin for the server to finish): past it, the server hears ``cancel``, as
it does for a question the runner cannot relay at all (URL mode, no turn).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from holdfast_shared.ids import new_id
from holdfast_shared.jobs import ElicitationAnswer, InboxMessage, ToolCallJob, ToolElicitation
from holdfast_shared.redisconn import blpop_within
from mcp.client.session import ClientRequestContext
from mcp_types import ElicitRequestFormParams, ElicitRequestParams, ElicitResult
from pydantic import BaseModel
from redis.asyncio import Redis

log = logging.getLogger(__name__)

# Of the call's time, what the server keeps to go on after the answer.
_FINISH_SHARE = 0.2
_FINISH_MAX_SECONDS = 10.0
# A question answered in less than this is not worth asking (the call is nearly out of time).
MIN_WAIT_SECONDS = 1.0
# The turn answers by its own bound; the runner waits a little longer, so the
# turn's answer (``cancel`` when that bound passed) rather than silence decides.
_TURN_MARGIN_SECONDS = 2.0

# What the connectors call with a server's question; its answer goes back to the server.
Elicitor = Callable[[ClientRequestContext, ElicitRequestParams], Awaitable[ElicitResult]]

CANCEL = ElicitResult(action="cancel")


def wait_bound(timeout_seconds: float, elapsed: float) -> float:
    """How long a person may take to answer, ``elapsed`` seconds into a call of
    ``timeout_seconds``: what is left, less the server's share to finish."""
    margin = min(timeout_seconds * _FINISH_SHARE, _FINISH_MAX_SECONDS)
    return max(0.0, timeout_seconds - elapsed - margin)


class ElicitationRelay:
    """Asks ``job``'s turn each question its server sends (see the module docstring)."""

    def __init__(self, redis: Redis, job: ToolCallJob) -> None:
        self.redis = redis
        self.job = job
        self._started = time.monotonic()

    async def __call__(
        self, context: ClientRequestContext, params: ElicitRequestParams
    ) -> ElicitResult:
        if not isinstance(params, ElicitRequestFormParams):
            # A URL to open is for a person at a browser, which no HITL answer is.
            return CANCEL
        wait = wait_bound(self.job.timeout_seconds, time.monotonic() - self._started)
        if wait < MIN_WAIT_SECONDS:
            return CANCEL

        def question(reply_key: str) -> ToolElicitation:
            return ToolElicitation(
                message=params.message,
                requested_schema=dict(params.requested_schema),
                reply_key=reply_key,
                wait_seconds=wait,
            )

        raw = await ask_turn(self.redis, self.job, "tool_elicitation", question, wait)
        if raw is None:
            log.info("call %s: nobody answered its server's question", self.job.tool_call_id)
            return CANCEL
        answer = ElicitationAnswer.model_validate_json(raw)
        return ElicitResult(action=answer.action, content=answer.content)


async def ask_turn(
    redis: Redis,
    job: ToolCallJob,
    kind: Literal["tool_elicitation", "tool_sampling"],
    request: Callable[[str], BaseModel],
    wait: float,
) -> str | None:
    """Send ``job``'s turn the request ``request(reply_key)`` makes and wait
    ``wait`` seconds (and a margin) for its answer on that key; None when none
    came, or the request could not be sent."""
    reply_key = f"{job.reply_to}:{kind}:{new_id('ask')}"
    message = InboxMessage(
        kind=kind,
        correlation_id=f"{job.task_id}:{job.tool_call_id}",
        payload=request(reply_key).model_dump(),
    )
    try:
        await redis.xadd(job.reply_to, message.to_fields(), maxlen=10_000)
        popped = await blpop_within(redis, [reply_key], wait + _TURN_MARGIN_SECONDS)
    except Exception:
        log.exception("could not relay a %s request of call %s", kind, job.tool_call_id)
        return None
    finally:
        await redis.delete(reply_key)
    return None if popped is None else popped[1]


async def unanswerable(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
    """For a question outside any turn's call (a probe's, a stray one): cancelled."""
    return CANCEL
