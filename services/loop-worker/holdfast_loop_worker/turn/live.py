"""The engine's turn handle: :class:`LiveTurn`, one turn on this worker, built
from the worker's :class:`TurnContext`, implementing every protocol of
``handle.py`` over Redis, PostgreSQL, the providers and the tool-runners."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from holdfast_shared import endpoint_calls
from holdfast_shared.agents import AgentDefinition
from holdfast_shared.assets import ServerTool
from holdfast_shared.db.models import Message
from holdfast_shared.eventlog import Emitter, EventLog, LoggedEvent, Writes, one_statement
from holdfast_shared.events import ToolProgress
from holdfast_shared.jobs import (
    ElicitationAnswer,
    InboxMessage,
    SamplingAnswer,
    ToolElicitation,
    ToolOutcome,
    ToolSampling,
    TurnJob,
    elicitation_answered_key,
)
from holdfast_shared.keys import Keys
from holdfast_shared.memory import Brain
from holdfast_shared.providers import ModelChoice, ProviderRegistry
from holdfast_shared.providers.calls import configured_limits
from holdfast_shared.redisconn import BLOCK_SLICE_SECONDS, blpop_within
from holdfast_shared.turnlock import TurnLock
from holdfast_shared.turnqueue import queue_turn
from redis.asyncio import Redis
from sqlalchemy import Executable
from sqlalchemy.dialects.postgresql import Insert, insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker import executions
from holdfast_loop_worker.blocks import StreamBlocks
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.context.budget import Overflow
from holdfast_loop_worker.context.engine import ContextEngine, TurnScope
from holdfast_loop_worker.hitl import Answer, HumanChannel, Kind, Question
from holdfast_loop_worker.lease import Leases
from holdfast_loop_worker.skills import TurnSkills
from holdfast_loop_worker.steering import Steer, pending_steers, start_following
from holdfast_loop_worker.stopping import TurnStop
from holdfast_loop_worker.subagents import Child, DepthExceeded, Parent, Subagents
from holdfast_loop_worker.toolcalls import CallContext, ToolCaller
from holdfast_loop_worker.trajectory import TurnEnding, announce, trajectory_insert
from holdfast_loop_worker.turn.handle import Seen
from holdfast_loop_worker.turn.hitl import elicit
from holdfast_loop_worker.turn.result import stored as stored_result
from holdfast_loop_worker.turn.rows import end_statements
from holdfast_loop_worker.turn.sampling import sample
from holdfast_loop_worker.turn_state import (
    PARKED_GRACE,
    PendingCall,
    Snapshots,
    TurnState,
    cut_off,
)
from holdfast_loop_worker.webhook_outbox import turn_end_insert

# An answer the runner never popped (its call ended) goes after this long.
_ANSWER_TTL_SECONDS = 120


@dataclass
class TurnContext:
    """What every turn needs; built once per worker process."""

    sessions: async_sessionmaker[AsyncSession]
    # Autocommit sessions for look-ups alone (holdfast_shared.db.autocommit_session_factory).
    reads: async_sessionmaker[AsyncSession]
    redis: Redis
    keys: Keys
    eventlog: EventLog
    providers: ProviderRegistry
    snapshots: Snapshots
    leases: Leases
    lock: TurnLock
    human: HumanChannel
    tools: ToolCaller | None
    max_iterations: int
    deadline_seconds: float
    hitl_ttl_seconds: int
    context: ContextEngine
    agent_models: dict[str, str] = field(default_factory=dict)
    retry_attempts: int = 4
    # Child tasks of delegate calls (None: this worker offers no delegation).
    subagents: Subagents | None = None
    max_subagents: int = 4
    max_subagent_depth: int = 2


class LiveTurn:
    """The engine's :class:`TurnHandle` (and every step's protocol above): one
    turn on this worker, over ``ctx``."""

    def __init__(self, ctx: TurnContext, job: TurnJob) -> None:
        self.ctx = ctx
        self.job = job
        self.emitter = Emitter(ctx.eventlog, job.task_id, job.turn_id)
        # The turn's events go to its emitter directly: no hop of ours on
        # every delta's way (docs/architecture.md counts them).
        self.emit = self.emitter.emit
        self.emit_body = self.emitter.emit_body
        self.state = TurnState()
        # The state as the last snapshot committed it (or as the turn began), as
        # written (to_json): what a snapshot taken mid-step keeps (turn_state.cut_off).
        self.boundary: dict[str, Any] = self.state.to_json()
        self.seen = Seen()
        # Stops requested from outside (cancel, hand-back, pause): see stopping.py.
        self.stop = TurnStop()
        self.execution: executions.ExecutionRun | None = None
        # The task that delegated to this turn's task (a subagent's), read when claimed.
        self.subagent_of: str | None = None
        self.stream: StreamBlocks | None = None
        self.streaming = False
        self.resuming = False
        self.used_tools = False
        self.agent = job.agent
        # The request's model; the agent may prefer another (start.py resolves it).
        self.model = job.model
        # Who the model is in this turn (system prompt, tools, policy, network),
        # resolved when the turn starts or resumes.
        self.definition: AgentDefinition | None = None
        # The tools of the agent's Asset Directory servers, by the model's name
        # (``{server}__{tool}``), read with the agent.
        self.server_tools: dict[str, ServerTool] = {}
        # The agent's skills (in the system prompt, the skill tool, the sandbox's
        # mounts), read with the agent.
        self.skills = TurnSkills()
        self.choice: ModelChoice | None = None
        # The end user whose brain the turn reads and feeds ("" is the tenant's).
        self.user_id = ""
        # When the turn was queued (its row's created_at), read when claimed.
        self.queued_at: datetime | None = None
        # What the task's last turn left (tasks row), for a turn that starts fresh.
        self.stored_memory: dict[str, Any] | None = None
        self.stored_calibration: float | None = None
        self.reported_usage: dict[str, int] | None = None
        # ``output_schema`` (turn/result.py), read from the turn's row when claimed.
        self.output_schema: dict[str, Any] | None = None
        # The boundary check before the next call may have run already when a
        # pause is published: that call is cut as it starts.
        self.pause_pending = False
        self._started = time.monotonic()

    @property
    def task_name(self) -> str:
        return self.emitter.task_name

    @property
    def provider_name(self) -> str | None:
        return self.choice.provider.name if self.choice else None

    @property
    def model_label(self) -> str | None:
        """``provider:model`` once the model is resolved."""
        return f"{self.choice.provider.name}:{self.choice.model}" if self.choice else None

    @property
    def definition_resolved(self) -> AgentDefinition:
        assert self.definition is not None, "the agent is resolved when the turn is driven"
        return self.definition

    async def snapshot(
        self,
        reason: str,
        *,
        advance: bool = True,
        message: Insert | None = None,
        statements: Sequence[Executable] = (),
    ) -> None:
        """Save the turn's state, with the step's ``message`` (from :meth:`message`) if any.

        Everything up to the snapshot is in PostgreSQL before the snapshot is, in one
        transaction with it: even a Redis that loses its data loses at most the next
        step, and a step's message and the state that counts it commit together.
        Drains first: a writer that was taken over finds out (Superseded) here,
        before it could overwrite the new owner's message.
        """
        last_seq = await self.emitter.drain()
        if advance:
            self.state.last_seq = last_seq or self.state.last_seq
        now = time.monotonic()
        self.state.active_ms += int((now - self._started) * 1000)
        self._started = now
        # Mid-step (advance=False) the step's own changes are not committed: the
        # last boundary's state is kept, with the time and usage since.
        # Serialised once: the same dict is written and kept as the boundary.
        state = (
            self.state.to_json()
            if advance
            else cut_off(TurnState.from_json(self.boundary), self.state).to_json()
        )
        ctx, job = self.ctx, self.job
        if not statements:
            # The common step: its events, message and state as one SQL statement
            # (one round trip, no BEGIN/COMMIT), the per-iteration cost of durability.
            snapshot = ctx.snapshots.statement(job.task_id, job.turn_id, reason, state)
            step = (message, snapshot) if message is not None else (snapshot,)
            await ctx.eventlog.archive_now(job.task_id, also=Writes(step))
        else:

            async def write(session: AsyncSession) -> None:
                if message is not None:
                    await session.execute(message)
                for statement in statements:
                    await session.execute(statement)
                ctx.snapshots.add(session, job.task_id, job.turn_id, reason, state)

            await ctx.eventlog.archive_now(job.task_id, also=write)
        self.boundary = state

    def message(self, role: str, content: dict[str, Any]) -> Insert:
        """The statement storing a message at the state's next position, which it takes;
        a repeated step overwrites its own."""
        statement = insert(Message).values(
            task_id=self.job.task_id,
            turn_id=self.job.turn_id,
            position=self.state.position,
            role=role,
            content=content,
        )
        self.state.position += 1
        return statement.on_conflict_do_update(
            index_elements=[Message.turn_id, Message.position],
            set_={"content": content, "role": role},
        )

    async def store(self, message: Insert) -> None:
        """Store a message outside a snapshot (drains first, as :meth:`snapshot` does)."""
        await self.emitter.drain()
        async with self.ctx.sessions.begin() as session:
            await session.execute(message)

    async def cancel_requested(self) -> bool:
        flag = await self.ctx.redis.get(self.ctx.keys.cancel(self.job.task_id))
        return bool(flag == self.job.turn_id)

    def active_ms(self) -> int:
        """The turn's active time so far: what its snapshots counted, plus this
        worker's run since the last one (:meth:`snapshot` moves it over)."""
        return self.state.active_ms + int((time.monotonic() - self._started) * 1000)

    async def requeue(self, job: TurnJob) -> None:
        await queue_turn(self.ctx.redis, self.ctx.keys, job)

    @property
    def pausable(self) -> bool:
        """An execution's turn, or a subagent's (its parent's pause reaches it)."""
        return self.execution is not None or self.subagent_of is not None

    def interrupt_for_pause(self) -> None:
        """A pause published for this turn: a model call streaming now is cut off;
        between two calls the pause is kept for the next one (see
        ``executions.interrupt_for_pause``)."""
        if self.streaming:
            self.stop.request("pause")
        else:
            self.pause_pending = True

    def events_after(self, seq: int) -> AsyncIterator[list[LoggedEvent]]:
        """The task's logged events after ``seq``, in pages."""
        return self.ctx.eventlog.pages_after(self.job.task_id, seq)

    async def keep_task_while_parked(self) -> None:
        """The task's turn lock outlives the longest a question (or a pause) waits."""
        ctx = self.ctx
        await ctx.lock.extend(
            self.job.task_id,
            self.job.turn_id,
            ctx.hitl_ttl_seconds + int(PARKED_GRACE.total_seconds()),
        )

    async def release_lease(self, *, status: str | None = None) -> None:
        await self.ctx.leases.release(self.job.turn_id, status=status)

    async def stop_tools(self) -> None:
        if self.ctx.tools is not None:
            await self.ctx.tools.turn_ended(self.job.tenant_id, self.job.task_id)

    # -- the turn's end ---------------------------------------------------------------
    def ending(
        self, status: str, stop_reason: str | None, error: dict[str, Any] | None
    ) -> TurnEnding:
        job = self.job
        return TurnEnding(
            tenant_id=job.tenant_id,
            user_id=self.user_id,
            task_id=job.task_id,
            task_name=self.emitter.task_name,
            turn_id=job.turn_id,
            agent=self.definition.name if self.definition else self.agent,
            model=self.model_label or self.model,
            status=status,
            stop_reason=stop_reason,
            error=error,
            usage=dict(self.state.usage),
            active_ms=self.state.active_ms,
            started_at=self.queued_at,
        )

    async def finish_events(self, last: list[Any]) -> None:
        """Log the terminal events and free the task, in one atomic step."""
        await self.emitter.finish(last)

    async def release_task(self) -> None:
        await self.ctx.lock.release(self.job.task_id, self.job.turn_id)

    async def record_end(self, ending: TurnEnding) -> None:
        ctx, job = self.ctx, self.job
        if self.used_tools and ctx.tools is not None:
            # The watchdog: no process a tool started outlives its turn, but
            # the task's stdio MCP servers, kept for its next turns.
            await ctx.tools.turn_ended(job.tenant_id, job.task_id, keep_servers=True)
        # The turn's end is one statement, atomic alone: an autocommit session, no
        # BEGIN and COMMIT; the trajectory's reads before it, on the same connection.
        async with ctx.reads() as session:
            trajectory = await trajectory_insert(session, ending)
            end = end_statements(
                task_id=job.task_id,
                turn_id=job.turn_id,
                status=ending.status,
                stop_reason=ending.stop_reason,
                usage=self.state.usage,
                active_ms=self.active_ms(),
                working_memory=self.state.working_memory,
                calibration=self.state.calibration,
                result=stored_result(self) if ending.status == "completed" else None,
            )
            # The webhook's outbox row (if the turn is subscribed) with the end it reports.
            last_seq = self.emitter.last_seq or self.seen.last_seq
            webhook = turn_end_insert(ending, last_seq=last_seq)
            await session.execute(one_statement([*end, webhook, trajectory]))
        await announce(ctx.redis, ctx.keys, job.tenant_id, job.turn_id)
        await ctx.redis.delete(ctx.keys.cancel(job.task_id))

    async def end_execution(self, status: str, last: list[Any]) -> None:
        await executions.turn_ended(self, self.ctx, status, last)

    async def start_following(self) -> None:
        ctx = self.ctx
        await start_following(
            ctx.sessions, ctx.reads, ctx.redis, ctx.keys, ctx.lock, ctx.eventlog, self.job.task_id
        )

    # -- the model step's collaborators ---------------------------------------------
    @property
    def retry_attempts(self) -> int:
        return self.ctx.retry_attempts

    async def prepare(
        self, choice: ModelChoice, *, harder: bool = False, overflow: Overflow | None = None
    ) -> Assembled:
        """The request of the next model call, compacted to fit (``harder``, or
        after an ``overflow``: more)."""
        job, agent = self.job, self.definition_resolved
        scope = TurnScope(
            job.tenant_id,
            job.task_id,
            job.turn_id,
            self.state.position,
            self.user_id,
            agent=agent.name,
        )
        prepared = await self.ctx.context.prepare(
            scope,
            self.state,
            choice,
            system_prompt=self.skills.system_prompt(agent.system_prompt),
            # Without tool-runners, no tools at all (as the tool step answers).
            tools=(
                (*agent.tool_specs(), *(t.spec for t in self.server_tools.values()))
                if self.ctx.tools is not None
                else ()
            ),
            emit=self.emit,
            harder=harder,
            brief_system_prompt=self.skills.system_prompt(agent.system_prompt, brief=True),
            overflow=overflow,
        )
        if self.output_schema is None:
            return prepared
        # Each call asks its provider for the schema natively (providers/structured.py).
        request = replace(prepared.request, output_schema=self.output_schema)
        return replace(prepared, request=request)

    def calling_model(self, choice: ModelChoice) -> AbstractAsyncContextManager[None]:
        """The model call under way on its endpoint while the block runs
        (a self-hosted one's only: ``endpoint_calls.endpoint_of``)."""
        return endpoint_calls.calling(
            self.ctx.redis,
            self.ctx.keys,
            endpoint_calls.endpoint_of(choice.provider),
            limit_seconds=configured_limits().call * self.retry_attempts,
        )

    def window_filled(self, choice: ModelChoice, tokens: int) -> None:
        self.ctx.context.learn_filled(choice.model, tokens)

    def prompt_answered(self, choice: ModelChoice, tokens: int) -> None:
        self.ctx.context.answered(choice.model, tokens)

    def largest_answered(self, choice: ModelChoice) -> int:
        return self.ctx.context.fitted(choice.model)

    async def pending_steers(self) -> list[Steer]:
        return await pending_steers(self.ctx.reads, self.job.task_id)

    async def logged_seq(self) -> int:
        await self.emitter.drain()
        last = await self.ctx.eventlog.last_hot_seq(self.job.task_id)
        return last if last is not None else self.state.last_seq

    # -- the user -------------------------------------------------------------------
    async def open_question(
        self,
        kind: Kind,
        text: str,
        tool_call: dict[str, Any] | None,
        *,
        ttl_seconds: float | None = None,
    ) -> Question:
        return await self.ctx.human.open(
            tenant_id=self.job.tenant_id,
            task_id=self.job.task_id,
            turn_id=self.job.turn_id,
            kind=kind,
            question=text,
            tool_call=tool_call,
            ttl_seconds=ttl_seconds,
        )

    async def read_question(self, request_id: str) -> tuple[Question, Answer]:
        return await self.ctx.human.read(request_id)

    async def answer_arrived(self, request_id: str, within: float) -> None:
        """Back when the gateway says ``request_id`` was answered, or after
        ``within`` (at most one Redis block): the caller reads the row either way,
        so a lost wake-up costs a few seconds, not the answer."""
        key = elicitation_answered_key(self.ctx.keys.prefix, request_id)
        await blpop_within(self.ctx.redis, [key], min(within, BLOCK_SLICE_SECONDS))

    async def end_question(self, request_id: str) -> bool:
        return await self.ctx.human.expire(request_id)

    async def answer_server(
        self, reply_key: str, answer: ElicitationAnswer | SamplingAnswer
    ) -> None:
        async with self.ctx.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(reply_key, answer.model_dump_json())
            pipe.expire(reply_key, _ANSWER_TTL_SECONDS)
            await pipe.execute()

    # -- the tool step's collaborators ----------------------------------------------
    @property
    def tools_available(self) -> bool:
        return self.ctx.tools is not None

    def agent_has_tool(self, name: str) -> bool:
        return name in self.definition_resolved.tools

    def server_tool(self, name: str) -> ServerTool | None:
        return self.server_tools.get(name)

    def tool_policy(self, name: str, server_tool: ServerTool | None) -> str:
        assert self.ctx.tools is not None, "routed to the policy only with tool-runners"
        # A call that reaches the policy may start a process (a sandbox, an MCP
        # server): the turn's end then tells the tool-runners (record_end).
        self.used_tools = True
        return self.ctx.tools.policy(self.definition_resolved, name, server_tool)

    async def run_tool(
        self, call: PendingCall, server_tool: ServerTool | None, *, attempt: int = 1
    ) -> ToolOutcome:
        tools = self.ctx.tools
        assert tools is not None, "routed to a tool-runner only with tool-runners"
        job = self.job
        context = CallContext(
            job.tenant_id,
            job.task_id,
            job.turn_id,
            self.definition_resolved,
            skills=self.skills.mounted,
        )
        return await tools.run(
            context,
            call.id,
            call.name,
            call.input,
            recall=self.resuming,
            server_tool=server_tool,
            attempt=attempt,
            on_progress=lambda report: self.emit(
                ToolProgress(tool_call_id=call.id, **report.model_dump())
            ),
            on_request=lambda request: self._server_request(call, request),
        )

    async def _server_request(self, call: PendingCall, request: InboxMessage) -> None:
        """A running call's server asks something of the turn (the runner waits)."""
        if request.kind == "tool_elicitation":
            await elicit(self, call, ToolElicitation.model_validate(request.payload))
        elif request.kind == "tool_sampling":
            assert self.choice is not None, "the model is resolved before any tool runs"
            asked = ToolSampling.model_validate(request.payload)
            async with self.calling_model(self.choice):
                answer = await sample(
                    self.choice, asked, attempts=self.retry_attempts, usage=self.state.usage
                )
            await self.answer_server(asked.reply_key, answer)

    async def working_memory(self, tool_input: Mapping[str, Any]) -> ToolOutcome:
        return await self.ctx.context.working_memory_call(
            self.job.task_id, self.state, tool_input, self.emit
        )

    async def memory_search(self, tool_input: Mapping[str, Any]) -> ToolOutcome:
        return await self.ctx.context.memory.search_call(self._brain, tool_input)

    async def memory_save(self, tool_input: Mapping[str, Any]) -> ToolOutcome:
        return await self.ctx.context.memory.save_call(self._brain, self.job.task_id, tool_input)

    async def skill(self, tool_input: dict[str, Any]) -> ToolOutcome:
        assert self.choice is not None, "the model is resolved before any tool runs"
        return await self.skills.call(
            self.ctx.sessions,
            tool_input,
            self.choice,
            attempts=self.ctx.retry_attempts,
            usage=self.state.usage,
        )

    @property
    def subagent_names(self) -> tuple[str, ...]:
        return self.definition_resolved.subagents if self.ctx.subagents is not None else ()

    @property
    def max_subagents(self) -> int:
        return self.ctx.max_subagents

    async def start_child(
        self, agent: str, brief: str, tool_call_id: str, files: Sequence[str]
    ) -> Child:
        children = self.ctx.subagents
        assert children is not None, "delegate calls are routed only with subagents"
        job = self.job
        depth = await children.depth_of(job.task_id)
        if depth + 1 > self.ctx.max_subagent_depth:
            raise DepthExceeded(
                f"this task is a subagent {depth} deep already: HOLDFAST_MAX_SUBAGENT_DEPTH "
                f"({self.ctx.max_subagent_depth}) allows no deeper delegation; do the work yourself"
            )
        parent = Parent(job.tenant_id, job.task_id, job.turn_id, self.user_id, self.model, depth)
        return await children.start(parent, agent, brief, tool_call_id, files)

    def child_events(self, child: Child, after_seq: int) -> AsyncIterator[list[LoggedEvent]]:
        assert self.ctx.subagents is not None
        return self.ctx.subagents.events(child, after_seq)

    async def child_answer(self, child: Child) -> str:
        assert self.ctx.subagents is not None
        return await self.ctx.subagents.answer(child)

    async def stop_children(self) -> None:
        if self.ctx.subagents is not None:
            await self.ctx.subagents.stop_children(self.job.tenant_id, self.job.task_id)

    @property
    def _brain(self) -> Brain:
        return Brain(self.job.tenant_id, self.user_id)
