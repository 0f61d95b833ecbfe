"""Run one turn: model iterations until a stop condition, every step as an event.

Event order for a plain answer (the gateway already logged ``started``)::

    content_block_start → text_delta… → content_block_stop → usage
    → thread_lifecycle completed (stop_reason)

With tools, each ``tool_use`` block becomes a ``tool_call`` event, the calls
run (a permission prompt first where the policy says ``ask``), and their
``tool_result`` events follow in order; the results go back to the model.
``end_turn`` / ``stop_sequence`` / ``max_tokens`` end the turn (``completed``
carries the stop reason); ``HOLDFAST_MAX_ITERATIONS`` bounds runaway loops;
``usage`` sums every iteration.

Durability. The loop is a small state machine (``state.py``) snapshotted at
every boundary, so any worker can continue it: after a crash (the lease ran
out), a hand-back on shutdown, an answered HITL request or a Redis that lost
its data. A continued turn first emits ``turn_resumed``; if the step that
was cut off had already emitted events (a model call's partial deltas),
``turn_resumed`` names them (``discard_from_seq``..``discard_to_seq``) and
the step runs again. Tool calls are not run again: their outcomes are stored
by call id.

Endings. A failure emits ``error`` (stable code) and ``thread_lifecycle``
``errored``; past ``HOLDFAST_TURN_DEADLINE_SECONDS`` the code is
``DEADLINE_EXCEEDED``. ``POST /execute/cancel`` ends the turn with
``thread_lifecycle`` ``completed`` and ``stop_reason: "cancelled"``. If a
stream breaks after output reached the client, the open blocks are closed
(``content_block_stop``) before the ``error``, and the partial message is
stored marked ``interrupted``. The task takes its next message either way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from holdfast_shared.agents import AgentDefinition, AgentNotFound, model_for, resolve_agent
from holdfast_shared.assets import ServerTool
from holdfast_shared.db.models import HitlRequestRecord, Message, Task, Turn
from holdfast_shared.errors import ErrorCode, Parked, StepInterrupted, Superseded
from holdfast_shared.eventlog import EventLog, Writes, next_epoch, one_statement
from holdfast_shared.events import (
    TERMINAL_PHASES,
    ContentBlockStart,
    ContentBlockStop,
    ErrorEvent,
    HitlRequest,
    HitlResolved,
    TextDelta,
    ThinkingDelta,
    ThreadLifecycle,
    ToolCall,
    ToolResult,
    TurnResumed,
    Usage,
    UserMessage,
    parse_event,
    turn_of,
)
from holdfast_shared.jobs import ToolOutcome, TurnJob
from holdfast_shared.keys import Keys
from holdfast_shared.memory import Brain
from holdfast_shared.observability import metrics
from holdfast_shared.observability.modelcalls import observed_model_call
from holdfast_shared.providers import (
    BlockStart,
    BlockStop,
    Finish,
    ModelChoice,
    ModelEvent,
    ProviderError,
    ProviderRegistry,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    UnknownModel,
    UsageReport,
)
from holdfast_shared.providers.retry import stream_with_retries
from holdfast_shared.tools import (
    ASK_USER,
    MEMORY_SAVE,
    MEMORY_SEARCH,
    SKILL,
    WORKING_MEMORY,
)
from holdfast_shared.turnlock import TurnLock
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy import Executable, select, update
from sqlalchemy.dialects.postgresql import Insert, insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker import executions
from holdfast_loop_worker.blocks import Block
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.context.engine import ContextEngine, TurnScope
from holdfast_loop_worker.context.tokens import recalibrate
from holdfast_loop_worker.emitter import Emitter
from holdfast_loop_worker.hitl import Answer, HumanChannel
from holdfast_loop_worker.lease import Leases
from holdfast_loop_worker.skills import TurnSkills
from holdfast_loop_worker.state import PendingCall, Snapshots, TurnState
from holdfast_loop_worker.steering import pending_steers, start_following, taken_in
from holdfast_loop_worker.stopping import TurnStop
from holdfast_loop_worker.toolcalls import CallContext, ToolCaller, preview
from holdfast_loop_worker.trajectory import TurnEnding, announce, trajectory_insert

log = logging.getLogger(__name__)


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
class _Seen:
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


# What a model call emits; after the last snapshot, these belong to a call
# that was cut off.
_MODEL_OUTPUT = frozenset(
    {"content_block_start", "content_block_stop", "text_delta", "thinking_delta", "tool_call"}
)


# Tools the loop answers itself, whose outcomes (or effects: working memory,
# a saved fact, a model sub-call's usage) only a snapshot keeps. Every other
# call's outcome is a ``tool_results`` row the runner wrote (or a refusal the
# policy gives again), which a resumed turn reads back instead of running the
# call: those calls need no snapshot each, one after the batch does.
_OUTCOME_ONLY_IN_SNAPSHOT = frozenset(
    {ASK_USER.name, WORKING_MEMORY.name, MEMORY_SAVE.name, MEMORY_SEARCH.name, SKILL.name}
)


class TurnRunner:
    """Runs (or continues) one turn until it ends, parks or is handed back."""

    def __init__(self, ctx: TurnContext, job: TurnJob, *, resume_reason: str | None) -> None:
        self.ctx = ctx
        self.job = job
        self.resume_reason = resume_reason
        self.emitter = Emitter(ctx.eventlog, job.task_id, job.turn_id)
        self.state = TurnState()
        self.seen = _Seen()
        self.blocks: dict[int, Block] = {}
        self.used_tools = False
        # A resumed turn may have run some of its calls already (their outcomes are
        # stored); a turn on its first run cannot have.
        self.resuming = False
        self.provider_name: str | None = None
        self.model_name: str | None = None
        self.agent = job.agent
        # The request's model; the agent may prefer another (_drive).
        self.model = job.model
        # Who the model is in this turn (system prompt, tools, policy, network),
        # resolved when the turn starts or resumes (_drive).
        self.definition: AgentDefinition | None = None
        # The tools of the agent's Asset Directory servers, by the model's name
        # (``{server}__{tool}``), read with the agent (_drive).
        self.server_tools: dict[str, ServerTool] = {}
        # The agent's skills (in the system prompt, the skill tool, the sandbox's
        # mounts) and the turn's model, read with the agent (_drive).
        self.skills = TurnSkills()
        self.choice: ModelChoice | None = None
        # Stops requested from outside (cancel, hand-back): see stopping.py.
        self.stop = TurnStop()
        # What the task's last turn left (tasks row), for a turn that starts fresh.
        self._stored_memory: dict[str, Any] | None = None
        self._stored_calibration: float | None = None
        # The prompt size the provider reported for the current model call
        # (context calibration: set against the request's own estimate).
        self._prompt_tokens = 0
        # The usage totals last sent as an event by this worker.
        self._reported_usage: dict[str, int] | None = None
        self._started = time.monotonic()
        # The end user whose brain the turn reads and feeds ("" is the tenant's).
        self.user_id = ""
        # When the turn was queued (its row's created_at), read when claimed.
        self.queued_at: datetime | None = None
        # The execution this turn runs, if any (executions.py), read when claimed.
        self.execution: executions.ExecutionRun | None = None
        # Inside a model call's stream (_call).
        self.streaming = False
        # A pause published while no model call streamed: the next call is cut
        # as it starts (the boundary check before it may have run already).
        self.pause_pending = False

    @property
    def _brain(self) -> Brain:
        return Brain(self.job.tenant_id, self.user_id)

    # -- lifecycle -------------------------------------------------------------
    async def run(self) -> str:
        """Returns ``completed``, ``errored``, ``cancelled``, ``parked``,
        ``handed_back``, ``skipped`` (it is over), ``busy`` (another worker
        holds it) or ``superseded`` (another worker took it over while this
        one stalled)."""
        row = await self._load_turn()  # as it was before this worker claimed it
        if row is None:
            return "skipped"
        leases = self.ctx.leases
        if not await leases.claim(self.job.turn_id) and not await leases.claim_after_lapse(
            self.job.turn_id, row.lease_until
        ):
            # Another worker holds it and renews it: leave the job pending; it is
            # offered again once its lease runs out.
            return "busy"
        metrics.lease_claimed(row.lease_owner, leases.owner)
        # From here on, a worker that stalled past its lease and wakes up
        # finds its appends refused (fenced) instead of writing over ours.
        self.emitter.epoch = await next_epoch(self.ctx.redis, self.ctx.keys, self.job.task_id)
        try:
            return await self._run_claimed(row)
        except Superseded:
            log.warning("turn %s was taken over by another worker; stopping", self.job.turn_id)
            return "superseded"

    async def _run_claimed(self, row: Turn) -> str:
        self.user_id = row.user_id
        self.queued_at = row.created_at
        self.execution = await executions.ExecutionRun.load(self)
        snapshot = await self.ctx.snapshots.latest(self.job.turn_id)
        # A turn that never ran (its first job was lost) just starts.
        resuming = snapshot is not None or (
            self.resume_reason is not None and row.status != "queued"
        )
        if snapshot is not None:
            self.state = snapshot
        self.resuming = resuming
        await self.ctx.lock.ensure(self.job.task_id, self.job.turn_id)
        await self.ctx.context.begin_turn(
            self.job.task_id,
            self.state,
            resumed=snapshot is not None,
            stored=self._stored_memory,
            calibration=self._stored_calibration,
        )
        if snapshot is None and self._state_expired(row):
            # Its channel state outlived its TTL: the turn cannot go on, and a
            # client replaying it learns so from the error.
            return await self._fail(
                ErrorCode.CHANNEL_STATE_EXPIRED,
                "the turn's saved state expired before it could continue; send the message again",
            )
        try:
            if await self._cancel_requested():
                return await self._end_cancelled()
            if resuming:
                await self._announce_resume()
                if self.seen.terminal:
                    status = self.seen.terminal_status
                    await self._end(status, self.seen.terminal_stop_reason, [])
                    return status
            budget = max(0.0, self.ctx.deadline_seconds - self.state.active_ms / 1000)
            if self.execution is not None:
                budget = self.execution.budget(budget, self.state.active_ms)
            async with asyncio.timeout(budget):
                stop_reason = await self._drive()
        except Parked as parked:
            return await self._park(parked.request_id)
        except executions.PauseRequested:
            return await executions.park_paused(self)
        except TimeoutError:
            await self._close_open_blocks()
            if self.execution is not None and self.execution.budget_is_execution:
                return await self._fail(
                    ErrorCode.EXECUTION_MAX_DURATION, self.execution.deadline_message()
                )
            return await self._fail(
                ErrorCode.DEADLINE_EXCEEDED,
                f"the turn ran past HOLDFAST_TURN_DEADLINE_SECONDS ({self.ctx.deadline_seconds:g})",
            )
        except asyncio.CancelledError:
            reason = self.stop.consume()
            if reason == "cancel":
                # What the model had said is kept: the conversation goes on from it.
                cut = self.blocks
                await self._close_open_blocks()
                if cut:
                    await self._store(self._message("assistant", self._partial(cut)))
                return await self._end_cancelled()
            if reason == "handoff":
                return await self._hand_back()
            if reason == "pause":
                return await executions.park_paused(self, cut=True)
            raise
        except Superseded:
            raise
        except StepInterrupted as exc:
            await self._store(self._message("assistant", exc.content))
            return await self._fail(exc.error.code, exc.error.message, exc.error.details)
        except ProviderError as exc:
            return await self._fail(exc.code, exc.message, exc.details)
        except UnknownModel as exc:
            return await self._fail(ErrorCode.UNKNOWN_MODEL, str(exc))
        except AgentNotFound as exc:
            # A custom agent deleted before this (resumed) turn could read it.
            return await self._fail(exc.code, exc.message, exc.details)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            # Redis restarting, or loading its file after one (BusyLoadingError):
            # a transient state, not a reason to end the user's turn. The turn is
            # left as a crash leaves it: the consumer keeps its job pending and
            # gives up its lease, and it resumes from its last snapshot once
            # Redis answers (what it emitted since is named by turn_resumed).
            log.warning(
                "turn %s stopped by an unreachable Redis (%s); it resumes once Redis answers",
                self.job.turn_id,
                type(exc).__name__,
            )
            raise
        except Exception as exc:
            log.exception("turn %s failed", self.job.turn_id)
            return await self._fail(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}")
        await self._end(
            "completed",
            stop_reason,
            [*self._final_usage(), ThreadLifecycle(phase="completed", stop_reason=stop_reason)],
        )
        return "completed"

    async def _drive(self) -> str:
        # Read again by a worker that resumes the turn: the agent is named on
        # the turn's row, and a custom one deleted since fails the turn here.
        agent = await resolve_agent(self.ctx.sessions, self.job.tenant_id, self.agent)
        self.definition = agent
        if self.ctx.tools is not None:
            self.server_tools = await self.ctx.tools.server_tools(self.job.tenant_id, agent)
        self.skills = await TurnSkills.load(
            self.ctx.sessions, self.job.tenant_id, agent, tools=self.ctx.tools is not None
        )
        choice = self.ctx.providers.resolve(
            model_for(
                agent,
                requested=self.model,
                overrides=self.ctx.agent_models,
                served=self.ctx.providers.names,
            )
        )
        self.provider_name = choice.provider.name
        self.model_name = choice.model
        self.choice = choice
        if not self.resuming:
            metrics.turn_started(agent.name, f"{choice.provider.name}:{choice.model}")
        state = self.state
        while True:
            # A step boundary: an execution may pause or checkpoint here.
            await executions.at_boundary(self)
            if state.stage == "final":
                return state.stop_reason or "end_turn"
            if state.stage == "tools":
                await self._run_tools()
                continue
            if state.iteration >= self.ctx.max_iterations:
                raise ProviderError(
                    ErrorCode.MAX_ITERATIONS,
                    f"the turn reached HOLDFAST_MAX_ITERATIONS ({self.ctx.max_iterations})",
                )
            # The iteration boundary: messages steered into the turn join it here.
            await self._take_steers()
            await self._model_step(choice)

    # -- model calls -----------------------------------------------------------
    async def _model_step(self, choice: ModelChoice) -> None:
        state = self.state
        prepared = await self._prepare(choice)
        try:
            blocks, stop_reason = await self._call(choice, prepared)
        except ProviderError as exc:
            if exc.code != ErrorCode.CONTEXT_OVERFLOW:
                raise
            # Our estimate was short of the provider's count: compact harder, once.
            log.warning("turn %s: the provider found the context too long", self.job.turn_id)
            smaller = await self._prepare(choice, harder=True)
            if smaller.tokens >= prepared.tokens:
                raise  # nothing left to compact: the turn fails with the provider's error
            blocks, stop_reason = await self._call(choice, smaller)
        await self.emitter.emit(self._usage(record=True))
        content = {
            "blocks": [b.to_content() for b in blocks],
            "stop_reason": stop_reason,
            "provider": choice.provider.name,
        }
        message = self._message("assistant", content)
        state.iteration += 1
        calls = [b for b in blocks if b.block_type == "tool_use"]
        if stop_reason == "tool_use" and calls:
            state.stage = "tools"
            state.pending = [
                PendingCall(b.tool_call_id or "", b.tool_name or "", b.tool_input()) for b in calls
            ]
        else:
            state.stage = "final"
            state.stop_reason = stop_reason
        await self._snapshot("model_call", message=message)

    async def _prepare(self, choice: ModelChoice, *, harder: bool = False) -> Assembled:
        scope = TurnScope(
            self.job.tenant_id,
            self.job.task_id,
            self.job.turn_id,
            self.state.position,
            self.user_id,
        )
        return await self.ctx.context.prepare(
            scope,
            self.state,
            choice,
            system_prompt=self.skills.system_prompt(self._agent.system_prompt),
            # Without tool-runners, no tools at all (as _call_outcome answers).
            tools=(
                (*self._agent.tool_specs(), *(t.spec for t in self.server_tools.values()))
                if self.ctx.tools is not None
                else ()
            ),
            emit=self.emitter.emit,
            harder=harder,
        )

    async def _call(self, choice: ModelChoice, prepared: Assembled) -> tuple[list[Block], str]:
        """One model call; its reported prompt size calibrates the next estimates."""
        self._prompt_tokens = 0
        attempts = self.ctx.retry_attempts
        stream = observed_model_call(
            choice.provider.name,
            choice.model,
            stream_with_retries(choice.provider, prepared.request, attempts=attempts),
        )
        # A pause may cut a model call short (executions.interrupt_for_pause).
        self.streaming = True
        if self.pause_pending:
            self.stop.request("pause")
        try:
            result = await self._model_call(stream)
        finally:
            self.streaming = False
        self.state.calibration = recalibrate(
            self.state.calibration, prepared.tokens, self._prompt_tokens
        )
        return result

    async def _model_call(self, stream: AsyncIterator[ModelEvent]) -> tuple[list[Block], str]:
        self.blocks = blocks = dict[int, Block]()
        stop_reason = "end_turn"
        emit = self.emitter.emit
        try:
            async for item in stream:
                if isinstance(item, TextChunk):
                    blocks[item.index].add(item)
                    await emit(TextDelta(text=item.text))
                elif isinstance(item, ThinkingChunk):
                    blocks[item.index].add(item)
                    await emit(ThinkingDelta(text=item.text))
                elif isinstance(item, ToolInputChunk):
                    blocks[item.index].add(item)
                elif isinstance(item, BlockStart):
                    blocks[item.index] = Block.opened(item)
                    await emit(
                        ContentBlockStart(block_index=item.index, block_type=item.block_type)
                    )
                elif isinstance(item, BlockStop):
                    await self._close(item.index, blocks[item.index], item)
                elif isinstance(item, UsageReport):
                    self._prompt_tokens += (
                        item.input_tokens
                        + item.cache_creation_input_tokens
                        + item.cache_read_input_tokens
                    )
                    self.state.add_usage(
                        {
                            "input_tokens": item.input_tokens,
                            "output_tokens": item.output_tokens,
                            "cache_creation_input_tokens": item.cache_creation_input_tokens,
                            "cache_read_input_tokens": item.cache_read_input_tokens,
                            "reasoning_tokens": item.reasoning_tokens,
                        }
                    )
                elif isinstance(item, Finish):
                    stop_reason = item.stop_reason
        except ProviderError as exc:
            if not blocks:
                raise
            await self._close_open_blocks()
            content = {
                "blocks": [blocks[i].to_content() for i in sorted(blocks)],
                "interrupted": True,
                "provider": self.provider_name,
            }
            raise StepInterrupted(exc, content) from exc
        self.blocks = {}
        return [blocks[i] for i in sorted(blocks)], stop_reason

    async def _close(
        self, index: int, block: Block, stop: BlockStop | None, *, announce_tool: bool = True
    ) -> None:
        block.close(stop)
        await self.emitter.emit(ContentBlockStop(block_index=index, block_type=block.block_type))
        if block.block_type == "tool_use" and announce_tool:
            await self.emitter.emit(
                ToolCall(
                    tool=block.tool_name or "",
                    tool_call_id=block.tool_call_id or "",
                    input=block.tool_input(),
                )
            )

    def _partial(self, blocks: dict[int, Block]) -> dict[str, Any]:
        """The stored content of a model call cut off after ``blocks`` began."""
        return {
            "blocks": [blocks[i].to_content() for i in sorted(blocks)],
            "interrupted": True,
            "provider": self.provider_name,
        }

    async def _close_open_blocks(self) -> None:
        """Close what a cut-off model call left open, so the client's view is whole."""
        for index, block in sorted(self.blocks.items()):
            if not block.closed:
                await self._close(index, block, None, announce_tool=False)
        self.blocks = {}

    # -- tools -----------------------------------------------------------------
    async def _run_tools(self) -> None:
        state = self.state
        for call in state.pending:
            if call.outcome is None:
                outcome = await self._call_outcome(call)
                if call.id not in self.seen.tool_results:
                    await self.emitter.emit(
                        ToolResult(tool_call_id=call.id, output=outcome.output, error=outcome.error)
                    )
                call.outcome = outcome.model_dump()
                if call.name in _OUTCOME_ONLY_IN_SNAPSHOT:
                    await self._snapshot("tool_result")
        results: list[dict[str, Any]] = []
        for call in state.pending:
            assert call.outcome is not None
            result: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": call.id,
                "output": call.outcome.get("output"),
            }
            if call.outcome.get("error") is not None:
                result["error"] = call.outcome["error"]
            results.append(result)
        message = self._message("user", {"blocks": results})
        state.stage = "model"
        state.pending = []
        await self._snapshot("tool_results", message=message)

    async def _call_outcome(self, call: PendingCall) -> ToolOutcome:
        tools = self.ctx.tools
        if tools is None:
            return ToolOutcome(error="tools are not available on this engine")
        server_tool = self.server_tools.get(call.name)
        if call.name not in self._agent.tools and server_tool is None:
            return ToolOutcome(error=f"unknown tool {call.name!r}")
        if call.name == ASK_USER.name:
            return await self._ask_user(call)
        if call.name == WORKING_MEMORY.name:
            return await self.ctx.context.working_memory_call(
                self.job.task_id, self.state, call.input, self.emitter.emit
            )
        self.used_tools = True
        rule = tools.policy(self._agent, call.name, server_tool)
        if rule == "unknown":
            return ToolOutcome(error=f"unknown tool {call.name!r}")
        if rule == "deny":
            return ToolOutcome(error=f"permission denied: the policy does not allow {call.name!r}")
        if rule == "ask":
            refusal = await self._permission(call)
            if refusal is not None:
                return refusal
        if call.name == SKILL.name and self.choice is not None:
            return await self.skills.call(
                self.ctx.sessions,
                call.input,
                self.choice,
                attempts=self.ctx.retry_attempts,
                usage=self.state.usage,
            )
        memory = self.ctx.context.memory
        if call.name == MEMORY_SEARCH.name:
            return await memory.search_call(self._brain, call.input)
        if call.name == MEMORY_SAVE.name:
            return await memory.save_call(self._brain, self.job.task_id, call.input)
        ctx = CallContext(
            self.job.tenant_id,
            self.job.task_id,
            self.job.turn_id,
            self._agent,
            skills=self.skills.mounted,
        )
        return await tools.run(
            ctx, call.id, call.name, call.input, recall=self.resuming, server_tool=server_tool
        )

    async def _permission(self, call: PendingCall) -> ToolOutcome | None:
        """None when the user allowed the call; else the outcome the model sees."""
        answer = await self._ask(
            call,
            "permission",
            f"Allow the agent to run {call.name}? {preview(call.input)}",
            {"tool": call.name, "tool_call_id": call.id, "input": call.input},
        )
        if answer.status == "expired":
            return ToolOutcome(error="permission request expired without an answer")
        if (answer.answer or "").strip().lower() != "yes":
            feedback = f" Feedback: {answer.feedback}" if answer.feedback else ""
            return ToolOutcome(error=f"the user denied permission to run {call.name}.{feedback}")
        return None

    async def _ask_user(self, call: PendingCall) -> ToolOutcome:
        """The model's own question (the ``ask_user`` tool): the answer is the result."""
        question = call.input.get("question")
        if not isinstance(question, str) or not question.strip():
            return ToolOutcome(error="ask_user needs a non-empty 'question' string")
        answer = await self._ask(call, "question", question, None)
        if answer.status == "expired":
            return ToolOutcome(error="the user did not answer before the question expired")
        output: dict[str, Any] = {"answer": answer.answer}
        if answer.feedback:
            output["feedback"] = answer.feedback
        if answer.content_blocks:
            output["content_blocks"] = answer.content_blocks
        return ToolOutcome(output=output)

    async def _ask(
        self,
        call: PendingCall,
        kind: Literal["permission", "question"],
        text: str,
        tool_call: dict[str, Any] | None,
    ) -> Answer:
        """The user's answer; parks the turn (raises :class:`Parked`) while none is in."""
        human = self.ctx.human
        if call.hitl_request is None:
            opened = await human.open(
                tenant_id=self.job.tenant_id,
                task_id=self.job.task_id,
                turn_id=self.job.turn_id,
                kind=kind,
                question=text,
                tool_call=tool_call,
            )
            call.hitl_request = opened.request_id
            await self._snapshot("hitl")
        question, answer = await human.read(call.hitl_request)
        if answer.status == "pending":
            announced = call.hitl_announced or question.request_id in self.seen.hitl_requests
            call.hitl_announced = True
            if not announced:
                await self.emitter.emit(
                    HitlRequest(
                        request_id=question.request_id,
                        kind=question.kind,
                        question=question.question,
                        tool_call=question.tool_call,
                        expires_at=question.expires_at_ms,
                    )
                )
            raise Parked(question.request_id)
        if answer.status != "expired" and question.request_id not in self.seen.hitl_resolved:
            await self.emitter.emit(
                HitlResolved(request_id=question.request_id, answer=answer.answer)
            )
        return answer

    # -- resuming, parking, handing back ---------------------------------------
    async def _announce_resume(self) -> None:
        """Emit ``turn_resumed``, naming the cut-off step's events to discard."""
        seen = self.seen
        async for page in self.ctx.eventlog.pages_after(self.job.task_id, self.state.last_seq):
            for logged in page:
                if turn_of(logged.data) != self.job.turn_id:
                    continue
                if logged.type in _MODEL_OUTPUT:
                    seen.first_seq = seen.first_seq or logged.seq
                    seen.last_seq = logged.seq
                event = parse_event(logged.data)
                if isinstance(event, ToolResult):
                    seen.tool_results.add(event.tool_call_id)
                elif isinstance(event, HitlRequest):
                    seen.hitl_requests.add(event.request_id)
                elif isinstance(event, HitlResolved):
                    seen.hitl_resolved.add(event.request_id)
                elif isinstance(event, UserMessage):
                    seen.steers.add(event.message_id)
                elif isinstance(event, ThreadLifecycle) and event.phase in TERMINAL_PHASES:
                    seen.terminal = True
                    seen.terminal_stop_reason = event.stop_reason
                    seen.terminal_status = (
                        "cancelled" if event.stop_reason == "cancelled" else event.phase
                    )
        if seen.terminal:
            return  # it ended already; run() only records that
        reason = self.resume_reason or "resumed"
        if seen.first_seq is not None:
            # A model call was cut off mid-stream (its output is all that a
            # step emits besides tool results and questions, which are
            # tracked above): it runs again, and its partial output is marked
            # so a client can drop it.
            await self.emitter.emit(
                TurnResumed(
                    reason=reason,
                    discard_from_seq=seen.first_seq,
                    discard_to_seq=seen.last_seq,
                )
            )
        else:
            await self.emitter.emit(TurnResumed(reason=reason))

    async def _park(self, request_id: str) -> str:
        await self._snapshot("hitl")
        await self.ctx.lock.extend(
            self.job.task_id, self.job.turn_id, self.ctx.hitl_ttl_seconds + 3600
        )
        await self.ctx.leases.release(self.job.turn_id, status="parked")
        # An answer that came in since we read the request queued its resume job while
        # we still held the turn; whoever took that job may have found it busy. Queue
        # one more: resuming twice is harmless (the lease lets one through, and the
        # other finds the question answered or the turn over).
        _question, answer = await self.ctx.human.read(request_id)
        if answer.status != "pending":
            job = TurnJob.resuming(self.job.tenant_id, self.job.task_id, self.job.turn_id)
            await self.ctx.redis.xadd(self.ctx.keys.turns, job.to_fields())
        return "parked"

    async def _hand_back(self) -> str:
        """Shutdown: snapshot, give up the lease and queue the turn for another worker.

        The snapshot keeps the last boundary's ``last_seq``: what the cut-off
        step emitted since is then named by the resumer's ``turn_resumed``.
        """
        await self._snapshot("shutdown", advance=False)
        await self.ctx.leases.release(self.job.turn_id)
        job = self.job.model_copy(update={"resume": True})
        await self.ctx.redis.xadd(self.ctx.keys.turns, job.to_fields())
        return "handed_back"

    async def _take_steers(self) -> None:
        """Messages sent with ``on_busy: "steer"`` become this turn's (steering.py):
        logged, then stored with the step's snapshot."""
        steers = await pending_steers(self.ctx.reads, self.job.task_id)
        if not steers:
            return
        for steer in steers:
            if steer.message_id not in self.seen.steers:
                await self.emitter.emit(UserMessage(text=steer.text, message_id=steer.message_id))
                self.seen.steers.add(steer.message_id)
        stored = [self._message("user", steer.content) for steer in steers]
        await self._snapshot("steer", statements=[*stored, taken_in(steers)])

    async def _cancel_requested(self) -> bool:
        flag = await self.ctx.redis.get(self.ctx.keys.cancel(self.job.task_id))
        return bool(flag == self.job.turn_id)

    # -- endings ---------------------------------------------------------------
    async def _end_cancelled(self) -> str:
        await self._end(
            "cancelled",
            "cancelled",
            [*self._final_usage(), ThreadLifecycle(phase="completed", stop_reason="cancelled")],
        )
        return "cancelled"

    async def _fail(self, code: str, message: str, details: dict[str, Any] | None = None) -> str:
        await self._end(
            "errored",
            None,
            [
                *self._final_usage(),
                ErrorEvent(error=code, message=message, details=details),
                ThreadLifecycle(phase="errored"),
            ],
        )
        return "errored"

    async def _end(self, status: str, stop_reason: str | None, last: list[Any]) -> None:
        """Log the terminal events and free the task (one atomic step), then record it.

        A turn resumed after its terminal event was logged (the worker died
        just after) only records the end: the events are not logged twice.
        """
        ending = self._ending(status, stop_reason, last)
        # Counted before the terminal event: a client that saw it finds it counted.
        metrics.turn_ended(ending)
        if self.seen.terminal:
            await self.ctx.lock.release(self.job.task_id, self.job.turn_id)
        else:
            await self.emitter.finish(last)
        if self.used_tools and self.ctx.tools is not None:
            # The watchdog: no process a tool started outlives its turn.
            await self.ctx.tools.turn_ended(self.job.tenant_id, self.job.task_id)
        # The turn's end is one statement, atomic alone: an autocommit session, no
        # BEGIN and COMMIT; the trajectory's reads before it, on the same connection.
        async with self.ctx.reads() as session:
            trajectory = await trajectory_insert(session, ending)
            end = [
                update(Turn)
                .where(Turn.id == self.job.turn_id)
                .values(
                    status=status,
                    stop_reason=stop_reason,
                    finished_at=datetime.now(UTC),
                    lease_owner=None,
                    lease_until=None,
                    # The totals GET /tasks/{task_id} sums, committed with the end.
                    usage=dict(self.state.usage),
                    active_ms=self._active_ms(),
                ),
                # The task keeps what the context engine learned for its next turn.
                update(Task)
                .where(Task.id == self.job.task_id)
                .values(
                    working_memory=self.state.working_memory,
                    token_calibration=self.state.calibration,
                ),
                # A question nobody will read the answer to is closed with the turn.
                update(HitlRequestRecord)
                .where(
                    HitlRequestRecord.turn_id == self.job.turn_id,
                    HitlRequestRecord.status == "pending",
                )
                .values(status="cancelled"),
                trajectory,
            ]
            await session.execute(one_statement(end))
        await announce(self.ctx.redis, self.ctx.keys, self.job.tenant_id, self.job.turn_id)
        await self.ctx.redis.delete(self.ctx.keys.cancel(self.job.task_id))
        await executions.turn_ended(self, status, last)
        # The task is free: a message that waited for this turn starts now.
        ctx = self.ctx
        await start_following(
            ctx.sessions, ctx.reads, ctx.redis, ctx.keys, ctx.lock, ctx.eventlog, self.job.task_id
        )

    def _ending(self, status: str, stop_reason: str | None, last: list[Any]) -> TurnEnding:
        error = next((e for e in last if isinstance(e, ErrorEvent)), None)
        return TurnEnding(
            tenant_id=self.job.tenant_id,
            user_id=self.user_id,
            task_id=self.job.task_id,
            task_name=self.emitter.task_name,
            turn_id=self.job.turn_id,
            agent=self.definition.name if self.definition else self.agent,
            model=f"{self.provider_name}:{self.model_name}" if self.provider_name else self.model,
            status=status,
            stop_reason=stop_reason,
            error={"code": error.error, "message": error.message} if error else None,
            usage=dict(self.state.usage),
            active_ms=self.state.active_ms,
            started_at=self.queued_at,
        )

    def _final_usage(self) -> list[Usage]:
        """The turn's total before its terminal event, unless the last ``usage``
        this worker sent (after the last model call) says it already."""
        if self._reported_usage == self.state.usage:
            return []
        return [self._usage(record=True)]

    def _usage(self, *, record: bool = False) -> Usage:
        """``usage`` so far in the turn: cumulative over its model calls."""
        u = self.state.usage
        if record:
            self._reported_usage = dict(u)
        return Usage(
            input_tokens=u.get("input_tokens", 0),
            output_tokens=u.get("output_tokens", 0),
            cache_creation_input_tokens=u.get("cache_creation_input_tokens", 0),
            cache_read_input_tokens=u.get("cache_read_input_tokens", 0),
            reasoning_tokens=u.get("reasoning_tokens", 0),
            model=f"{self.provider_name}:{self.model_name}" if self.provider_name else None,
            active_seconds=self._active_ms() / 1000,
        )

    def _active_ms(self) -> int:
        """The turn's active time so far: what its snapshots counted, plus this
        worker's run since the last one (``_snapshot`` moves it over)."""
        return self.state.active_ms + int((time.monotonic() - self._started) * 1000)

    # -- persistence -----------------------------------------------------------
    async def _snapshot(
        self,
        reason: str,
        *,
        advance: bool = True,
        message: Insert | None = None,
        statements: Sequence[Executable] = (),
    ) -> None:
        """Save the turn's state, with the step's ``message`` (from ``_message``) if any.

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
        state = self.state
        if not statements:
            # The common step: its events, message and state as one SQL statement
            # (one round trip, no BEGIN/COMMIT), the per-iteration cost of durability.
            snapshot = self.ctx.snapshots.statement(
                self.job.task_id, self.job.turn_id, reason, state
            )
            step = (message, snapshot) if message is not None else (snapshot,)
            await self.ctx.eventlog.archive_now(self.job.task_id, also=Writes(step))
            return

        async def write(session: AsyncSession) -> None:
            if message is not None:
                await session.execute(message)
            for statement in statements:
                await session.execute(statement)
            self.ctx.snapshots.add(session, self.job.task_id, self.job.turn_id, reason, state)

        await self.ctx.eventlog.archive_now(self.job.task_id, also=write)

    def _state_expired(self, row: Turn) -> bool:
        """No live snapshot of a turn older than the snapshots' TTL: its state is gone.

        (A young turn without one simply died before its first snapshot and
        starts over.)
        """
        age = datetime.now(UTC) - row.created_at
        return row.status != "queued" and age > self.ctx.snapshots.active_ttl

    async def _load_turn(self) -> Turn | None:
        async with self.ctx.reads() as session:
            found = (
                await session.execute(
                    select(Turn, Task.name, Task.working_memory, Task.token_calibration)
                    .join(Task, Task.id == Turn.task_id)
                    .where(Turn.id == self.job.turn_id)
                )
            ).first()
        if found is None:
            return None  # its task was deleted
        row: Turn = found[0]
        self.emitter.task_name, self._stored_memory, self._stored_calibration = found[1:]
        if row.status not in ("queued", "running", "parked"):
            return None
        self.agent = self.job.agent or row.agent
        self.model = self.job.model or row.model
        return row

    @property
    def _agent(self) -> AgentDefinition:
        """The turn's agent, once ``_drive`` resolved it."""
        assert self.definition is not None, "the agent is resolved when the turn is driven"
        return self.definition

    def _message(self, role: str, content: dict[str, Any]) -> Insert:
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

    async def _store(self, message: Insert) -> None:
        """Store a message outside a snapshot (drains first, as ``_snapshot`` does)."""
        await self.emitter.drain()
        async with self.ctx.sessions.begin() as session:
            await session.execute(message)
