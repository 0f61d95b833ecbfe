"""The runner's side of an MCP server's sampling request (connectors/sampling.py),
on real Redis: a text conversation goes to the call's turn as a ``tool_sampling``
inbox message and the turn's completion goes back as MCP's result; what the
engine cannot sample (images, tools) or the turn could not answer is an MCP
error the server sees."""

from __future__ import annotations

import asyncio
import secrets
from typing import cast

from holdfast_shared.jobs import InboxMessage, SamplingAnswer, ToolCallJob, ToolSampling
from holdfast_tool_runner.connectors.sampling import SamplingRelay
from mcp.client.session import ClientRequestContext
from mcp_types import (
    CreateMessageRequestParams,
    CreateMessageResult,
    ErrorData,
    ImageContent,
    SamplingMessage,
    TextContent,
)
from redis.asyncio import Redis

# The relay reads nothing of the SDK's request context.
_CONTEXT = cast(ClientRequestContext, None)


def _job(redis_prefix: str) -> ToolCallJob:
    return ToolCallJob(
        tenant_id="t1",
        task_id=f"task-{secrets.token_hex(4)}",
        turn_id="turn-1",
        tool_call_id="call-1",
        tool="srv__sample",
        input={},
        reply_to=f"{redis_prefix}sampling-relay:{secrets.token_hex(4)}:inbox",
        server="srv",
        server_tool="sample",
    )


def _params(*content: TextContent | ImageContent) -> CreateMessageRequestParams:
    return CreateMessageRequestParams(
        messages=[SamplingMessage(role="user", content=list(content))],
        system_prompt="Be brief.",
        max_tokens=20,
    )


async def _served(
    redis: Redis, job: ToolCallJob, params: CreateMessageRequestParams, answer: SamplingAnswer
) -> tuple[ToolSampling, CreateMessageResult | ErrorData]:
    """The request as the turn gets it, and what the server gets after ``answer``."""
    asked = asyncio.create_task(SamplingRelay(redis, job)(_CONTEXT, params))
    try:
        got = await redis.xread({job.reply_to: "0-0"}, count=1, block=10_000)
        assert got, "no request reached the call's reply_to"
        message = InboxMessage.from_fields(got[0][1][0][1])
        assert message.kind == "tool_sampling"
        request = ToolSampling.model_validate(message.payload)
        await redis.rpush(request.reply_key, answer.model_dump_json())
        return request, await asyncio.wait_for(asked, timeout=10)
    finally:
        await redis.delete(job.reply_to)


async def test_a_text_conversation_is_answered_by_the_turn(redis: Redis, redis_prefix: str) -> None:
    job = _job(redis_prefix)
    params = _params(TextContent(type="text", text="two"), TextContent(type="text", text="rivers"))
    answer = SamplingAnswer(text="Nile, Amazon", model="scripted:m", stop_reason="endTurn")
    request, result = await _served(redis, job, params, answer)
    assert request.messages == [{"role": "user", "text": "two\nrivers"}]
    assert request.system_prompt == "Be brief." and request.max_tokens == 20
    assert isinstance(result, CreateMessageResult)
    assert result.content == TextContent(type="text", text="Nile, Amazon")
    assert result.model == "scripted:m" and result.stop_reason == "endTurn"


async def test_the_turns_failure_is_the_servers_error(redis: Redis, redis_prefix: str) -> None:
    job = _job(redis_prefix)
    failed = SamplingAnswer(error="the model call failed: overloaded")
    _, result = await _served(redis, job, _params(TextContent(type="text", text="hi")), failed)
    assert isinstance(result, ErrorData) and "overloaded" in result.message


async def test_an_image_is_refused_without_asking_the_turn(redis: Redis, redis_prefix: str) -> None:
    job = _job(redis_prefix)
    image = ImageContent(type="image", data="aGk=", mime_type="image/png")
    result = await SamplingRelay(redis, job)(_CONTEXT, _params(image))
    assert isinstance(result, ErrorData) and "text" in result.message
    assert not await redis.exists(job.reply_to)
