"""The turn's handle: all a step (and ``executions.py``) may reach of a running turn.

Steps take a :class:`TurnHandle`, never the conductor: they emit, snapshot, ask
the user, call tools and requeue through it, and reach Redis and PostgreSQL
only that way — so a step runs in a unit test against a small in-memory
handle, no servers. :class:`LiveTurn` is the engine's implementation, built
from the worker's :class:`TurnContext`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol

from holdfast_shared.agents import AgentDefinition
from holdfast_shared.assets import ServerTool
from holdfast_shared.db.models import Message
from holdfast_shared.eventlog import EventLog, LoggedEvent, Writes, one_statement
from holdfast_shared.events import _Event
from holdfast_shared.jobs import ToolOutcome, TurnJob
from holdfast_shared.keys import Keys
from holdfast_shared.memory import Brain
from holdfast_shared.providers import ModelChoice, ProviderRegistry
from holdfast_shared.turnlock import TurnLock
from holdfast_shared.turnqueue import queue_turn
from redis.asyncio import Redis
from sqlalchemy import Executable
from sqlalchemy.dialects.postgresql import Insert, insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker import executions
from holdfast_loop_worker.blocks import StreamBlocks
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.context.engine import ContextEngine, TurnScope
from holdfast_loop_worker.emitter import Emitter
from holdfast_loop_worker.hitl import Answer, HumanChannel, Question
from holdfast_loop_worker.lease import Leases
from holdfast_loop_worker.skills import TurnSkills
from holdfast_loop_worker.steering import Steer, pending_steers, start_following
from holdfast_loop_worker.stopping import TurnStop
from holdfast_loop_worker.toolcalls import CallContext, ToolCaller
from holdfast_loop_worker.trajectory import TurnEnding, announce, trajectory_insert
from holdfast_loop_worker.turn.rows import end_statements
from holdfast_loop_worker.turn_state import PendingCall, Snapshots, TurnState


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


@dataclass
class Seen:
    """Events of this turn logged after the last snapshot (read when resuming)."""

    first_seq: int | None = None
    last_seq: int | None = None
    terminal: bool = False
    terminal_status: str = "completed"
    terminal_stop_reason: str | None = None
    tool_results: set[str] = field(default_factory=set)
    hitl_requests: set[str] = field(default_factory=set)
    hitl_resolved: set[str] = field(default_factory=set)
    # Steering messages whose user_message event is logged already.
    steers: set[str] = field(default_factory=set)


class TurnHandle(Protocol):
    """A running turn, as its steps see it: what every step may use. A step that
    needs more says so with one of the protocols below, each this one plus the
    few collaborators of that step."""

    job: TurnJob
    state: TurnState
    seen: Seen
    stop: TurnStop
    execution: executions.ExecutionRun | None
    # The usage totals last sent as an event by this worker.
    reported_usage: dict[str, int] | None

    @property
    def task_name(self) -> str: ...
    @property
    def provider_name(self) -> str | None: ...
    @property
    def model_label(self) -> str | None: ...

    async def emit(self, event: _Event) -> None: ...
    async def snapshot(
        self,
        reason: str,
        *,
        advance: bool = True,
        message: Insert | None = None,
        statements: Sequence[Executable] = (),
    ) -> None: ...
    def message(self, role: str, content: dict[str, Any]) -> Insert: ...
    async def store(self, message: Insert) -> None: ...
    async def cancel_requested(self) -> bool: ...
    def active_ms(self) -> int: ...
    async def requeue(self, job: TurnJob) -> None: ...
    def interrupt_for_pause(self) -> None: ...


class ModelTurn(TurnHandle, Protocol):
    """The model step's (model_step.py)."""

    # The blocks of the model call under way or cut off, if any (a cancel or a
    # deadline closes them); None once a call completed.
    stream: StreamBlocks | None
    # Inside a model call's stream, where a pause cuts it off.
    streaming: bool
    # A pause published while no model call streamed: the next call is cut as it starts.
    pause_pending: bool

    @property
    def retry_attempts(self) -> int: ...
    async def prepare(self, choice: ModelChoice, *, harder: bool = False) -> Assembled: ...
    async def pending_steers(self) -> list[Steer]: ...


class AskingTurn(TurnHandle, Protocol):
    """Questions to the user (hitl.py)."""

    async def open_question(
        self,
        kind: Literal["permission", "question"],
        text: str,
        tool_call: dict[str, Any] | None,
    ) -> Question: ...
    async def read_question(self, request_id: str) -> tuple[Question, Answer]: ...


class ToolTurn(AskingTurn, Protocol):
    """The tool step's (tool_step.py): one method per route of its table."""

    @property
    def tools_available(self) -> bool: ...
    def agent_has_tool(self, name: str) -> bool: ...
    def server_tool(self, name: str) -> ServerTool | None: ...
    def tool_policy(self, name: str, server_tool: ServerTool | None) -> str: ...
    async def run_tool(self, call: PendingCall, server_tool: ServerTool | None) -> ToolOutcome: ...
    async def working_memory(self, tool_input: Mapping[str, Any]) -> ToolOutcome: ...
    async def memory_search(self, tool_input: Mapping[str, Any]) -> ToolOutcome: ...
    async def memory_save(self, tool_input: Mapping[str, Any]) -> ToolOutcome: ...
    async def skill(self, tool_input: dict[str, Any]) -> ToolOutcome: ...


class ParkingTurn(AskingTurn, Protocol):
    """Letting go of the turn without ending it (parking.py)."""

    async def keep_task_while_parked(self) -> None: ...
    async def release_lease(self, *, status: str | None = None) -> None: ...


class ResumingTurn(TurnHandle, Protocol):
    """Reading what the turn logged after its last snapshot (resume.py)."""

    def events_after(self, seq: int) -> AsyncIterator[list[LoggedEvent]]: ...


class EndingTurn(TurnHandle, Protocol):
    """The turn's end (ending.py)."""

    def ending(
        self, status: str, stop_reason: str | None, error: dict[str, Any] | None
    ) -> TurnEnding: ...
    async def finish_events(self, last: list[Any]) -> None: ...
    async def release_task(self) -> None: ...
    async def record_end(self, ending: TurnEnding) -> None: ...
    async def end_execution(self, status: str, last: list[Any]) -> None: ...
    async def start_following(self) -> None: ...


class LiveTurn:
    """The engine's :class:`TurnHandle` (and every step's protocol above): one
    turn on this worker, over ``ctx``."""

    def __init__(self, ctx: TurnContext, job: TurnJob) -> None:
        self.ctx = ctx
        self.job = job
        self.emitter = Emitter(ctx.eventlog, job.task_id, job.turn_id)
        self.state = TurnState()
        self.seen = Seen()
        # Stops requested from outside (cancel, hand-back, pause): see stopping.py.
        self.stop = TurnStop()
        self.execution: executions.ExecutionRun | None = None
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

    async def emit(self, event: _Event) -> None:
        await self.emitter.emit(event)

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
        state, ctx, job = self.state, self.ctx, self.job
        if not statements:
            # The common step: its events, message and state as one SQL statement
            # (one round trip, no BEGIN/COMMIT), the per-iteration cost of durability.
            snapshot = ctx.snapshots.statement(job.task_id, job.turn_id, reason, state)
            step = (message, snapshot) if message is not None else (snapshot,)
            await ctx.eventlog.archive_now(job.task_id, also=Writes(step))
            return

        async def write(session: AsyncSession) -> None:
            if message is not None:
                await session.execute(message)
            for statement in statements:
                await session.execute(statement)
            ctx.snapshots.add(session, job.task_id, job.turn_id, reason, state)

        await ctx.eventlog.archive_now(job.task_id, also=write)

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
        await ctx.lock.extend(self.job.task_id, self.job.turn_id, ctx.hitl_ttl_seconds + 3600)

    async def release_lease(self, *, status: str | None = None) -> None:
        await self.ctx.leases.release(self.job.turn_id, status=status)

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
            # The watchdog: no process a tool started outlives its turn.
            await ctx.tools.turn_ended(job.tenant_id, job.task_id)
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
            )
            await session.execute(one_statement([*end, trajectory]))
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

    async def prepare(self, choice: ModelChoice, *, harder: bool = False) -> Assembled:
        """The request of the next model call, compacted to fit (``harder``: more)."""
        job, agent = self.job, self.definition_resolved
        scope = TurnScope(
            job.tenant_id, job.task_id, job.turn_id, self.state.position, self.user_id
        )
        return await self.ctx.context.prepare(
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
        )

    async def pending_steers(self) -> list[Steer]:
        return await pending_steers(self.ctx.reads, self.job.task_id)

    # -- the user -------------------------------------------------------------------
    async def open_question(
        self,
        kind: Literal["permission", "question"],
        text: str,
        tool_call: dict[str, Any] | None,
    ) -> Question:
        return await self.ctx.human.open(
            tenant_id=self.job.tenant_id,
            task_id=self.job.task_id,
            turn_id=self.job.turn_id,
            kind=kind,
            question=text,
            tool_call=tool_call,
        )

    async def read_question(self, request_id: str) -> tuple[Question, Answer]:
        return await self.ctx.human.read(request_id)

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

    async def run_tool(self, call: PendingCall, server_tool: ServerTool | None) -> ToolOutcome:
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
            context, call.id, call.name, call.input, recall=self.resuming, server_tool=server_tool
        )

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
    def _brain(self) -> Brain:
        return Brain(self.job.tenant_id, self.user_id)
