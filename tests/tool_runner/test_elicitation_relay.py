"""The runner's side of an MCP server's question (connectors/elicitation.py), on
real Redis: the question goes to the call's ``reply_to`` as a ``tool_elicitation``
inbox message, the answer the turn pushes to its ``reply_key`` goes back to the
server, and a question nobody answers within the call's time is ``cancel``."""

from __future__ import annotations

import asyncio
import secrets
from typing import cast

from holdfast_shared.jobs import (
    ElicitationAnswer,
    InboxMessage,
    ToolCallJob,
    ToolElicitation,
)
from holdfast_tool_runner.connectors.elicitation import ElicitationRelay, wait_bound
from mcp.client.session import ClientRequestContext
from mcp_types import ElicitRequestFormParams, ElicitRequestURLParams
from redis.asyncio import Redis

_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
# The relay reads nothing of the SDK's request context.
_CONTEXT = cast(ClientRequestContext, None)


def _job(redis_prefix: str, timeout: float = 60.0) -> ToolCallJob:
    return ToolCallJob(
        tenant_id="t1",
        task_id=f"task-{secrets.token_hex(4)}",
        turn_id="turn-1",
        tool_call_id="call-1",
        tool="srv__ask",
        input={},
        reply_to=f"{redis_prefix}elicit-relay:{secrets.token_hex(4)}:inbox",
        timeout_seconds=timeout,
        server="srv",
        server_tool="ask",
    )


async def _question(redis: Redis, job: ToolCallJob) -> tuple[InboxMessage, ToolElicitation]:
    """The relayed question, read from the call's inbox as the loop-worker reads it."""
    got = await redis.xread({job.reply_to: "0-0"}, count=1, block=10_000)
    assert got, "no question reached the call's reply_to"
    _, entries = got[0]
    message = InboxMessage.from_fields(entries[0][1])
    return message, ToolElicitation.model_validate(message.payload)


async def test_the_question_goes_to_the_turn_and_its_answer_to_the_server(
    redis: Redis, redis_prefix: str
) -> None:
    job = _job(redis_prefix)
    relay = ElicitationRelay(redis, job)
    params = ElicitRequestFormParams(message="Your name?", requested_schema=_SCHEMA)
    asked = asyncio.create_task(relay(_CONTEXT, params))
    try:
        message, question = await _question(redis, job)
        assert message.kind == "tool_elicitation"
        assert message.correlation_id == f"{job.task_id}:{job.tool_call_id}"
        assert question.message == "Your name?" and question.requested_schema == _SCHEMA
        assert 0 < question.wait_seconds <= wait_bound(job.timeout_seconds, 0.0)
        answer = ElicitationAnswer(action="accept", content={"name": "Ada"})
        await redis.rpush(question.reply_key, answer.model_dump_json())
        result = await asyncio.wait_for(asked, timeout=10)
    finally:
        await redis.delete(job.reply_to)
    assert result.action == "accept" and result.content == {"name": "Ada"}
    assert not await redis.exists(question.reply_key)


async def test_nobody_answering_within_the_calls_time_is_cancel(
    redis: Redis, redis_prefix: str
) -> None:
    # 4 s call: 0.8 s kept for the server, ~3.2 s to answer (and the turn's margin).
    job = _job(redis_prefix, timeout=4.0)
    params = ElicitRequestFormParams(message="Your name?", requested_schema=_SCHEMA)
    try:
        result = await asyncio.wait_for(ElicitationRelay(redis, job)(_CONTEXT, params), 15)
        _, question = await _question(redis, job)
    finally:
        await redis.delete(job.reply_to)
    assert question.wait_seconds <= 3.2
    assert result.action == "cancel" and result.content is None


async def test_a_url_or_an_out_of_time_question_is_cancelled_unasked(
    redis: Redis, redis_prefix: str
) -> None:
    url = ElicitRequestURLParams(
        message="Log in", url="https://example.com/login", elicitation_id="e1"
    )
    job = _job(redis_prefix)
    assert (await ElicitationRelay(redis, job)(_CONTEXT, url)).action == "cancel"
    # Under a second of a call left: not worth asking.
    short = _job(redis_prefix, timeout=1.0)
    form = ElicitRequestFormParams(message="Your name?", requested_schema=_SCHEMA)
    assert (await ElicitationRelay(redis, short)(_CONTEXT, form)).action == "cancel"
    for asked in (job, short):
        assert not await redis.exists(asked.reply_to), "asked nobody, sent nothing"


def test_the_wait_leaves_the_server_time_to_finish() -> None:
    assert wait_bound(60.0, 0.0) == 50.0  # at most 10 s kept
    assert wait_bound(10.0, 0.0) == 8.0  # a fifth of a short call
    assert wait_bound(60.0, 45.0) == 5.0
    assert wait_bound(60.0, 59.0) == 0.0
