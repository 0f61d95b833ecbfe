"""Running the model's tool calls on the tool-runners.

Allowed calls go out as a :class:`~holdfast_shared.jobs.ToolCallJob`; the
reply comes to this worker's inbox, and the ``tool_results`` row is the
durable answer if the reply is missed (after a crash the next worker finds
it there: a call already executed is never executed again). Policy
decisions and permission prompts are the loop's (``turn/tool_step.py``): this module
only executes, and says what the policy is (:meth:`ToolCaller.policy`): the
turn's agent's (``holdfast_shared.agents``) under the operator's overrides.
An Asset Directory server's tool (an MCP tool, ``{server}__{tool}``) goes the
same way, to the same runners, with the server named on the job; its default
rule comes from the server's annotations (``holdfast_shared.assets.catalogue``).

A call whose outcome is unknown (its runner died mid-call, its time ran out,
its MCP connection broke after the request went: ``ToolOutcome.unknown``) is
sent again here, as its next ``attempt`` with the same idempotency key, when
its effect class (the agent's, ``AgentDefinition.effect``) is ``read_only`` or
``idempotent`` — up to ``HOLDFAST_TOOL_RETRIES`` times. An ``effectful`` call's
unknown outcome goes back to the tool step, which has a person settle it
(``turn/hitl.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from holdfast_shared.agents import AgentDefinition
from holdfast_shared.assets import ServerTool, agent_server_tools, rule_for
from holdfast_shared.assets.catalogue import server_wildcard
from holdfast_shared.db.models import ToolResultRecord
from holdfast_shared.jobs import (
    InboxMessage,
    ToolCallJob,
    ToolCallProgress,
    ToolOutcome,
)
from holdfast_shared.keys import REAP_TURN_END, Keys
from holdfast_shared.observability import tracing
from holdfast_shared.tools import BUILTIN_BY_NAME
from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.inbox import Inbox

log = logging.getLogger(__name__)

# Beyond the tool's own timeout, how long to wait for a runner to answer
# before looking for the stored result and then sending the call again.
_RUNNER_GRACE_SECONDS = 30.0


# Told of a running call's progress (the turn emits it as a tool_progress event).
OnProgress = Callable[[ToolCallProgress], Awaitable[None]]
# A running call's server's request of the turn (``tool_elicitation``: ask the
# user, turn/hitl.py; ``tool_sampling``: a model call), answered on its reply key.
OnServerRequest = Callable[[InboxMessage], Awaitable[None]]


async def _reply(
    reply: asyncio.Future[InboxMessage],
    progress: asyncio.Queue[InboxMessage] | None,
    on_progress: OnProgress | None,
    on_request: OnServerRequest | None = None,
) -> InboxMessage:
    """The call's reply; meanwhile its progress reports, in order, to ``on_progress``
    and its server's requests to ``on_request`` (from this task, the turn's, so
    its events keep their order)."""
    if progress is None or on_progress is None:
        return await reply

    async def heard(message: InboxMessage) -> None:
        if message.kind == "tool_progress":
            await on_progress(ToolCallProgress.model_validate(message.payload))
        elif on_request is not None:
            await on_request(message)

    while not reply.done():
        report = asyncio.ensure_future(progress.get())
        try:
            await asyncio.wait({reply, report}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not report.done():
                report.cancel()
        if report.done() and not report.cancelled():
            await heard(report.result())
    while not progress.empty():  # reports sent just before the reply
        await heard(progress.get_nowait())
    return reply.result()


@dataclass(frozen=True, slots=True)
class CallContext:
    tenant_id: str
    task_id: str
    turn_id: str
    agent: AgentDefinition
    # The agent's skills with files: mounted read-only in the call's sandbox.
    skills: tuple[str, ...] = ()


class ToolCaller:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        sessions: async_sessionmaker[AsyncSession],
        inbox: Inbox,
        *,
        permission: Callable[[str | None, str], str | None],
        network_agents: frozenset[str],
        timeout_seconds: float,
        retries: int = 2,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.sessions = sessions
        self.inbox = inbox
        self.permission = permission
        self.network_agents = network_agents
        self.timeout_seconds = timeout_seconds
        self.retries = retries

    def policy(
        self, agent: AgentDefinition, tool: str, server_tool: ServerTool | None = None
    ) -> str:
        """``allow``, ``ask`` or ``deny``: the operator's rule for the agent
        (``HOLDFAST_TOOL_PERMISSIONS``, via ``permission``), else the agent's own.
        ``unknown`` for a tool that is not the agent's (refused outright).

        For ``server_tool`` (one of the agent's servers' tools): the operator's
        rule by its name or ``{server}__*``, the agent's the same way, else
        ``allow`` for a tool the server marks read-only and ``ask`` for any other.
        """
        if server_tool is not None:
            return (
                self.permission(agent.name, server_tool.name)
                or self.permission(agent.name, server_wildcard(server_tool.server))
                or rule_for(server_tool, agent.permissions)
                or server_tool.default_permission()
            )
        if tool not in BUILTIN_BY_NAME or tool not in agent.tools:
            return "unknown"
        return self.permission(agent.name, tool) or agent.permission(tool)

    async def server_tools(self, tenant_id: str, agent: AgentDefinition) -> dict[str, ServerTool]:
        """The tools of the agent's Asset Directory servers, by the model's name for them."""
        if not agent.servers:
            return {}
        async with self.sessions() as session:
            found = await agent_server_tools(session, tenant_id, agent.servers)
        return {tool.name: tool for tool in found}

    def network(self, agent: AgentDefinition) -> bool:
        """Whether the agent's sandbox has the network: its definition says so,
        or the operator grants it (``HOLDFAST_NETWORK_AGENTS``)."""
        return agent.network or agent.name in self.network_agents

    async def run(
        self,
        ctx: CallContext,
        tool_call_id: str,
        tool: str,
        tool_input: dict[str, Any],
        *,
        recall: bool = True,
        server_tool: ServerTool | None = None,
        attempt: int = 1,
        on_progress: OnProgress | None = None,
        on_request: OnServerRequest | None = None,
    ) -> ToolOutcome:
        """Execute on a tool-runner (or recall the stored outcome) and wait for it.
        ``on_progress`` hears the call's progress reports (an MCP server's) meanwhile.

        ``recall=False`` (a turn on its first run) skips looking for a stored outcome
        before sending: there can be none, and a runner answers a call it already ran
        with the stored outcome anyway. ``attempt`` > 1 runs a call whose outcome
        was unknown again (a person's ``retry``). The outcome has ``unknown`` set
        only for an effectful call (or one out of retries).
        """
        outcome = await self._attempt(
            ctx,
            tool_call_id,
            tool,
            tool_input,
            recall=recall,
            server_tool=server_tool,
            attempt=attempt,
            on_progress=on_progress,
            on_request=on_request,
        )
        effect = ctx.agent.effect(tool, tool_input, server_tool)
        while (
            outcome.unknown is not None
            and effect != "effectful"
            and outcome.unknown.attempt <= self.retries
        ):
            log.warning(
                "tool call %s (%s) lost on attempt %d (%s): running it again",
                tool_call_id,
                effect,
                outcome.unknown.attempt,
                outcome.unknown.reason,
            )
            outcome = await self._attempt(
                ctx,
                tool_call_id,
                tool,
                tool_input,
                recall=False,
                server_tool=server_tool,
                attempt=outcome.unknown.attempt + 1,
                on_progress=on_progress,
                on_request=on_request,
            )
        return outcome

    async def _attempt(
        self,
        ctx: CallContext,
        tool_call_id: str,
        tool: str,
        tool_input: dict[str, Any],
        *,
        recall: bool,
        server_tool: ServerTool | None,
        attempt: int,
        on_progress: OnProgress | None,
        on_request: OnServerRequest | None = None,
    ) -> ToolOutcome:
        if recall:
            stored = await self.stored(ctx.task_id, tool_call_id)
            # An attempt not made yet must be sent; a later one's row says all.
            if stored is not None and (stored.unknown is None or stored.unknown.attempt >= attempt):
                return stored
        timeout = self.timeout_seconds
        if tool == "bash" and isinstance(tool_input.get("timeout"), int | float):
            timeout = min(float(tool_input["timeout"]), 600.0)
        job = ToolCallJob(
            tenant_id=ctx.tenant_id,
            task_id=ctx.task_id,
            turn_id=ctx.turn_id,
            tool_call_id=tool_call_id,
            tool=tool,
            input=tool_input,
            reply_to=self.inbox.stream,
            network=self.network(ctx.agent),
            timeout_seconds=timeout,
            skills=ctx.skills,
            server=server_tool.server if server_tool else None,
            server_tool=server_tool.tool if server_tool else None,
            traceparent=tracing.current_traceparent(),
            attempt=attempt,
        )
        correlation = f"{ctx.task_id}:{tool_call_id}"
        while True:
            reply = self.inbox.expect(correlation)
            progress = self.inbox.progress(correlation) if on_progress is not None else None
            try:
                await self.redis.xadd(self.keys.tools, job.to_fields())
                async with asyncio.timeout(timeout + _RUNNER_GRACE_SECONDS):
                    message = await _reply(reply, progress, on_progress, on_request)
                return ToolOutcome.model_validate(message.payload)
            except TimeoutError:
                stored = await self.stored(ctx.task_id, tool_call_id)
                if stored is not None and (
                    stored.unknown is None or stored.unknown.attempt >= attempt
                ):
                    return stored
                # The call was lost on the way (say, Redis restarted empty):
                # send it again; the runner's claim keeps it from running twice.
                log.warning("no answer for tool call %s; sending it again", tool_call_id)
            finally:
                self.inbox.forget(correlation)

    async def turn_ended(self, tenant_id: str, task_id: str, *, keep_servers: bool = False) -> None:
        """Ask every tool-runner to kill what the task's tools left running;
        ``keep_servers`` (a turn's normal end): but its stdio MCP servers."""
        request = f"{tenant_id} {task_id}"
        if keep_servers:
            request = f"{request} {REAP_TURN_END}"
        await self.redis.publish(self.keys.tools_reap, request)

    async def stored(self, task_id: str, tool_call_id: str) -> ToolOutcome | None:
        """The call's stored outcome (its result, or that it is unknown); None
        while it runs or before it was claimed."""
        async with self.sessions() as session:
            row = await session.scalar(
                select(ToolResultRecord).where(
                    ToolResultRecord.task_id == task_id,
                    ToolResultRecord.tool_call_id == tool_call_id,
                    ToolResultRecord.status != "running",
                )
            )
        return None if row is None else ToolOutcome.from_record(row)


def preview(tool_input: dict[str, Any], limit: int = 300) -> str:
    text = json.dumps(tool_input, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "…"
