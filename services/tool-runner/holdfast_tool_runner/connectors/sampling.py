"""A running MCP call's server asks for a model's completion (``sampling/createMessage``).

The runner has no model SDKs and no provider keys: the request goes to the turn
waiting for the call (an :class:`~holdfast_shared.jobs.InboxMessage` of kind
``tool_sampling``), whose loop-worker makes the call through the engine's own
providers under the agent's model, counts its tokens in the turn's usage, and
pushes a :class:`~holdfast_shared.jobs.SamplingAnswer` to the request's own
Redis list. Text only: a request with images, audio or tools is refused (an
MCP error the server sees), as is one the call's remaining time cannot wait for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from holdfast_shared.jobs import SamplingAnswer, ToolCallJob, ToolSampling
from mcp.client.session import ClientRequestContext
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    CreateMessageRequestParams,
    CreateMessageResult,
    ErrorData,
    TextContent,
)
from redis.asyncio import Redis

from holdfast_tool_runner.connectors.elicitation import MIN_WAIT_SECONDS, ask_turn, wait_bound

log = logging.getLogger(__name__)

# What the connectors call with a server's sampling request; the result goes back to it.
Sampler = Callable[
    [ClientRequestContext, CreateMessageRequestParams], Awaitable[CreateMessageResult | ErrorData]
]


def _texts(params: CreateMessageRequestParams) -> list[dict[str, str]] | None:
    """The conversation as ``{"role", "text"}``; None if any part is not text."""
    messages: list[dict[str, str]] = []
    for message in params.messages:
        parts = message.content if isinstance(message.content, list) else [message.content]
        if not parts or not all(isinstance(part, TextContent) for part in parts):
            return None
        text = "\n".join(part.text for part in parts if isinstance(part, TextContent))
        messages.append({"role": message.role, "text": text})
    return messages


class SamplingRelay:
    """Has ``job``'s turn answer each sampling request of its server (see the module docstring)."""

    def __init__(self, redis: Redis, job: ToolCallJob) -> None:
        self.redis = redis
        self.job = job
        self._started = time.monotonic()

    async def __call__(
        self, context: ClientRequestContext, params: CreateMessageRequestParams
    ) -> CreateMessageResult | ErrorData:
        messages = _texts(params)
        if params.tools or messages is None or not messages:
            return ErrorData(
                code=INVALID_PARAMS, message="this client samples text conversations only"
            )
        wait = wait_bound(self.job.timeout_seconds, time.monotonic() - self._started)
        if wait < MIN_WAIT_SECONDS:
            return ErrorData(code=INTERNAL_ERROR, message="no time left in the tool call to sample")

        def request(reply_key: str) -> ToolSampling:
            return ToolSampling(
                messages=messages,
                system_prompt=params.system_prompt,
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                reply_key=reply_key,
                wait_seconds=wait,
            )

        raw = await ask_turn(self.redis, self.job, "tool_sampling", request, wait)
        if raw is None:
            return ErrorData(
                code=INTERNAL_ERROR, message="the engine's model did not answer in time"
            )
        answer = SamplingAnswer.model_validate_json(raw)
        if answer.error is not None:
            return ErrorData(code=INTERNAL_ERROR, message=answer.error)
        return CreateMessageResult(
            role="assistant",
            content=TextContent(type="text", text=answer.text),
            model=answer.model,
            stop_reason=answer.stop_reason,
        )


async def unservable(
    context: ClientRequestContext, params: CreateMessageRequestParams
) -> CreateMessageResult | ErrorData:
    """For a request outside any turn's call (a probe's, a stray one): refused."""
    return ErrorData(code=INVALID_PARAMS, message="no model call can be made outside a tool call")
