"""Running the model's tool calls: permission policy, then the tool-runner.

A call the policy denies, or the user refuses, becomes an error outcome the
model reads (with the user's feedback), never a failed turn. Allowed calls
go to the tool-runners as a :class:`~holdfast_shared.jobs.ToolCallJob`; the
reply comes to this worker's inbox, and the ``tool_results`` row is the
durable answer if the reply is missed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from holdfast_shared.db.models import ToolResultRecord
from holdfast_shared.jobs import ToolCallJob, ToolOutcome
from holdfast_shared.keys import Keys
from holdfast_shared.tools import BUILTIN_BY_NAME
from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.emitter import Emitter
from holdfast_loop_worker.hitl import HumanChannel
from holdfast_loop_worker.inbox import Inbox

log = logging.getLogger(__name__)

# Beyond the tool's own timeout, how long to wait for a runner to answer.
_RUNNER_GRACE_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class CallContext:
    tenant_id: str
    task_id: str
    turn_id: str
    agent: str | None


class ToolCaller:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        sessions: async_sessionmaker[AsyncSession],
        inbox: Inbox,
        human: HumanChannel,
        *,
        permission: Callable[[str | None, str], str],
        network_agents: frozenset[str],
        timeout_seconds: float,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.sessions = sessions
        self.inbox = inbox
        self.human = human
        self.permission = permission
        self.network_agents = network_agents
        self.timeout_seconds = timeout_seconds

    async def call(
        self,
        emitter: Emitter,
        ctx: CallContext,
        tool_call_id: str,
        tool: str,
        tool_input: dict[str, Any],
    ) -> ToolOutcome:
        if tool not in BUILTIN_BY_NAME:
            return ToolOutcome(error=f"unknown tool {tool!r}")
        stored = await self._stored(ctx.task_id, tool_call_id)
        if stored is not None:
            return stored
        refusal = await self._check_permission(emitter, ctx, tool_call_id, tool, tool_input)
        if refusal is not None:
            return refusal
        return await self._run(ctx, tool_call_id, tool, tool_input)

    async def _check_permission(
        self,
        emitter: Emitter,
        ctx: CallContext,
        tool_call_id: str,
        tool: str,
        tool_input: dict[str, Any],
    ) -> ToolOutcome | None:
        rule = self.permission(ctx.agent, tool)
        if rule == "allow":
            return None
        if rule == "deny":
            return ToolOutcome(error=f"permission denied: the policy does not allow {tool!r}")
        answer = await self.human.ask(
            emitter,
            tenant_id=ctx.tenant_id,
            task_id=ctx.task_id,
            turn_id=ctx.turn_id,
            kind="permission",
            question=f"Allow the agent to run {tool}? {_preview(tool_input)}",
            tool_call={"tool": tool, "tool_call_id": tool_call_id, "input": tool_input},
        )
        if answer.expired:
            return ToolOutcome(error="permission request expired without an answer")
        if (answer.answer or "").strip().lower() != "yes":
            feedback = f" Feedback: {answer.feedback}" if answer.feedback else ""
            return ToolOutcome(error=f"the user denied permission to run {tool}.{feedback}")
        return None

    async def _run(
        self, ctx: CallContext, tool_call_id: str, tool: str, tool_input: dict[str, Any]
    ) -> ToolOutcome:
        timeout = self.timeout_seconds
        if tool == "bash" and isinstance(tool_input.get("timeout"), int | float):
            timeout = min(float(tool_input["timeout"]), 600.0)
        job = ToolCallJob(
            task_id=ctx.task_id,
            turn_id=ctx.turn_id,
            tool_call_id=tool_call_id,
            tool=tool,
            input=tool_input,
            reply_to=self.inbox.stream,
            network=(ctx.agent or "") in self.network_agents,
            timeout_seconds=timeout,
        )
        correlation = f"{ctx.task_id}:{tool_call_id}"
        reply = self.inbox.expect(correlation)
        try:
            await self.redis.xadd(self.keys.tools, job.to_fields())
            async with asyncio.timeout(timeout + _RUNNER_GRACE_SECONDS):
                message = await reply
            return ToolOutcome.model_validate(message.payload)
        except TimeoutError:
            stored = await self._stored(ctx.task_id, tool_call_id)
            if stored is not None:
                return stored
            return ToolOutcome(error="no tool-runner answered in time; the call did not complete")
        finally:
            self.inbox.forget(correlation)

    async def turn_ended(self, task_id: str) -> None:
        """Ask every tool-runner to kill what the task's tools left running."""
        await self.redis.publish(self.keys.tools_reap, task_id)

    async def _stored(self, task_id: str, tool_call_id: str) -> ToolOutcome | None:
        async with self.sessions() as session:
            row = await session.scalar(
                select(ToolResultRecord).where(
                    ToolResultRecord.task_id == task_id,
                    ToolResultRecord.tool_call_id == tool_call_id,
                    ToolResultRecord.status == "done",
                )
            )
        if row is None:
            return None
        return ToolOutcome(output=(row.output or {}).get("value"), error=row.error)


def _preview(tool_input: dict[str, Any], limit: int = 300) -> str:
    text = json.dumps(tool_input, ensure_ascii=False)
    return text if len(text) <= limit else text[:limit] + "…"
