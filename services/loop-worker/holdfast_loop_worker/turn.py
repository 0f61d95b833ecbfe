"""Run one turn: model iterations until a stop condition, every step as an event.

Event order for a plain answer (the gateway already logged ``started``)::

    content_block_start → text_delta… → content_block_stop → usage
    → thread_lifecycle completed (stop_reason)

With tools, each iteration's ``tool_use`` blocks become ``tool_call`` events,
the calls run (permission prompts included), ``tool_result`` events follow in
the same order, and the results go back to the model for the next iteration.
``end_turn`` / ``stop_sequence`` / ``max_tokens`` end the turn (``completed``
carries the stop reason); ``HOLDFAST_MAX_ITERATIONS`` bounds runaway loops.
The ``usage`` event sums every iteration.

A failure ends the turn with an ``error`` event and ``thread_lifecycle``
``errored``. If the model stream broke off after some output had been sent,
the blocks already opened are closed first (``content_block_stop``), so the
client's view is consistent: the partial text stays as sent, and the
stored assistant message is marked ``interrupted``. The task stays usable
for its next message either way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from holdfast_shared.conversation import ChatMessage, for_provider, load_history
from holdfast_shared.db.models import Message, Task, Turn
from holdfast_shared.errors import ErrorCode
from holdfast_shared.eventlog import EventLog
from holdfast_shared.events import (
    ContentBlockStart,
    ContentBlockStop,
    ErrorEvent,
    TextDelta,
    ThinkingDelta,
    ThreadLifecycle,
    ToolCall,
    ToolResult,
    Usage,
)
from holdfast_shared.jobs import TurnJob
from holdfast_shared.tools import BUILTIN_TOOLS
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.emitter import Emitter
from holdfast_loop_worker.providers import (
    BlockStart,
    BlockStop,
    Finish,
    ModelEvent,
    ModelRequest,
    ProviderError,
    ProviderRegistry,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    UnknownModel,
    UsageReport,
)
from holdfast_loop_worker.providers.retry import stream_with_retries
from holdfast_loop_worker.toolcalls import CallContext, ToolCaller

log = logging.getLogger(__name__)

SYSTEM_PROMPT = (
    "You are a helpful agent running on Holdfast. You work in a sandboxed workspace "
    "and can use the tools you are given."
)


@dataclass
class TurnContext:
    """What every turn needs; built once per worker process."""

    sessions: async_sessionmaker[AsyncSession]
    eventlog: EventLog
    providers: ProviderRegistry
    default_model: str | None
    max_iterations: int
    tools: ToolCaller | None = None
    retry_attempts: int = 4


@dataclass
class _UsageTotals:
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    reasoning_tokens: int = 0

    def add(self, report: UsageReport) -> None:
        self.input_tokens += report.input_tokens
        self.output_tokens += report.output_tokens
        self.cache_creation_input_tokens += report.cache_creation_input_tokens
        self.cache_read_input_tokens += report.cache_read_input_tokens
        self.reasoning_tokens += report.reasoning_tokens


@dataclass
class _Block:
    block_type: str
    text: str = ""
    signature: str | None = None
    redacted: str | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    partial_json: list[str] = field(default_factory=list)
    closed: bool = False

    def tool_input(self) -> dict[str, Any]:
        raw = "".join(self.partial_json)
        if not raw:
            return {}
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return {"_unparsed": raw}
        return value if isinstance(value, dict) else {"value": value}

    def to_content(self) -> dict[str, Any]:
        if self.block_type == "tool_use":
            call: dict[str, Any] = {
                "type": "tool_use",
                "id": self.tool_call_id,
                "name": self.tool_name,
                "input": self.tool_input(),
            }
            if self.signature:  # Gemini signs function calls and wants them back
                call["signature"] = self.signature
            return call
        block: dict[str, Any] = {"type": self.block_type, "text": self.text}
        if self.signature:
            block["signature"] = self.signature
        if self.redacted is not None:
            block["redacted"] = self.redacted
        return block


class _Interrupted(Exception):
    def __init__(self, error: ProviderError, blocks: list[_Block]) -> None:
        super().__init__(error.message)
        self.error = error
        self.blocks = blocks


class TurnRunner:
    """Runs one :class:`TurnJob` to a terminal lifecycle event."""

    def __init__(self, ctx: TurnContext, job: TurnJob) -> None:
        self.ctx = ctx
        self.job = job
        self.emitter = Emitter(ctx.eventlog, job.task_id, job.turn_id)
        self.usage = _UsageTotals()
        self.position = 1
        self.provider_name: str | None = None
        self.used_tools = False

    async def run(self) -> str:
        """Run the turn; returns the final status (``completed`` or ``errored``)."""
        try:
            stop_reason = await self._iterate()
        except _Interrupted as exc:
            await self._store(
                "assistant",
                {
                    "blocks": [b.to_content() for b in exc.blocks],
                    "interrupted": True,
                    "provider": self.provider_name,
                },
            )
            return await self._fail(exc.error.code, exc.error.message, exc.error.details)
        except ProviderError as exc:
            return await self._fail(exc.code, exc.message, exc.details)
        except UnknownModel as exc:
            return await self._fail(ErrorCode.UNKNOWN_MODEL, str(exc), None)
        except Exception as exc:
            log.exception("turn %s failed", self.job.turn_id)
            return await self._fail(
                ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}", None
            )
        await self._emit_usage()
        await self.emitter.emit(ThreadLifecycle(phase="completed", stop_reason=stop_reason))
        await self.emitter.drain()
        await self._finish("completed", stop_reason)
        return "completed"

    async def _iterate(self) -> str:
        choice = self.ctx.providers.resolve(await self._model_spec())
        self.provider_name = choice.provider.name
        await self._mark_running()
        async with self.ctx.sessions() as session:
            history = await load_history(session, self.job.task_id)
        tools = BUILTIN_TOOLS if self.ctx.tools is not None else ()
        for _ in range(self.ctx.max_iterations):
            request = ModelRequest(
                model=choice.model,
                system=SYSTEM_PROMPT,
                messages=tuple(for_provider(history, choice.provider.name)),
                tools=tools,
            )
            stream = stream_with_retries(choice.provider, request, attempts=self.ctx.retry_attempts)
            blocks, stop_reason = await self._model_call(stream)
            content = {
                "blocks": [b.to_content() for b in blocks],
                "stop_reason": stop_reason,
                "provider": choice.provider.name,
            }
            await self._store("assistant", content)
            history.append(
                ChatMessage(
                    "assistant",
                    tuple(content["blocks"]),
                    self.job.turn_id,
                    provider=choice.provider.name,
                )
            )
            calls = [b for b in blocks if b.block_type == "tool_use"]
            if stop_reason != "tool_use" or not calls:
                return stop_reason
            results = await self._run_tools(calls)
            await self._store("user", {"blocks": results})
            history.append(ChatMessage("user", tuple(results), self.job.turn_id))
        await self._emit_usage()
        raise ProviderError(
            ErrorCode.MAX_ITERATIONS,
            f"the turn reached HOLDFAST_MAX_ITERATIONS ({self.ctx.max_iterations}) iterations",
        )

    async def _model_call(self, stream: AsyncIterator[ModelEvent]) -> tuple[list[_Block], str]:
        blocks: dict[int, _Block] = {}
        stop_reason = "end_turn"
        emit = self.emitter.emit
        try:
            async for item in stream:
                if isinstance(item, TextChunk):
                    blocks[item.index].text += item.text
                    await emit(TextDelta(text=item.text))
                elif isinstance(item, ThinkingChunk):
                    blocks[item.index].text += item.text
                    await emit(ThinkingDelta(text=item.text))
                elif isinstance(item, ToolInputChunk):
                    blocks[item.index].partial_json.append(item.partial_json)
                elif isinstance(item, BlockStart):
                    blocks[item.index] = _Block(
                        item.block_type, tool_name=item.tool_name, tool_call_id=item.tool_call_id
                    )
                    await emit(
                        ContentBlockStart(block_index=item.index, block_type=item.block_type)
                    )
                elif isinstance(item, BlockStop):
                    blocks[item.index].redacted = item.redacted
                    await self._close(item.index, blocks[item.index], item.signature)
                elif isinstance(item, UsageReport):
                    self.usage.add(item)
                elif isinstance(item, Finish):
                    stop_reason = item.stop_reason
        except ProviderError as exc:
            if not blocks:
                raise
            for index, block in sorted(blocks.items()):
                if not block.closed:
                    await self._close(index, block, None, announce_tool=False)
            raise _Interrupted(exc, [blocks[i] for i in sorted(blocks)]) from exc
        return [blocks[i] for i in sorted(blocks)], stop_reason

    async def _close(
        self, index: int, block: _Block, signature: str | None, *, announce_tool: bool = True
    ) -> None:
        block.signature = signature
        block.closed = True
        await self.emitter.emit(
            ContentBlockStop(block_index=index, block_type=block.block_type)  # type: ignore[arg-type]
        )
        if block.block_type == "tool_use" and announce_tool:
            await self.emitter.emit(
                ToolCall(
                    tool=block.tool_name or "",
                    tool_call_id=block.tool_call_id or "",
                    input=block.tool_input(),
                )
            )

    async def _run_tools(self, calls: list[_Block]) -> list[dict[str, Any]]:
        assert self.ctx.tools is not None
        self.used_tools = True
        call_ctx = CallContext(
            tenant_id=self.job.tenant_id,
            task_id=self.job.task_id,
            turn_id=self.job.turn_id,
            agent=self.job.agent,
        )
        results: list[dict[str, Any]] = []
        for block in calls:
            call_id = block.tool_call_id or ""
            outcome = await self.ctx.tools.call(
                self.emitter, call_ctx, call_id, block.tool_name or "", block.tool_input()
            )
            await self.emitter.emit(
                ToolResult(tool_call_id=call_id, output=outcome.output, error=outcome.error)
            )
            result: dict[str, Any] = {
                "type": "tool_result",
                "tool_use_id": call_id,
                "output": outcome.output,
            }
            if outcome.error is not None:
                result["error"] = outcome.error
            results.append(result)
        return results

    async def _emit_usage(self) -> None:
        u = self.usage
        await self.emitter.emit(
            Usage(
                input_tokens=u.input_tokens,
                output_tokens=u.output_tokens,
                cache_creation_input_tokens=u.cache_creation_input_tokens,
                cache_read_input_tokens=u.cache_read_input_tokens,
                reasoning_tokens=u.reasoning_tokens,
            )
        )

    async def _fail(self, code: str, message: str, details: dict[str, Any] | None) -> str:
        await self.emitter.emit(ErrorEvent(error=code, message=message, details=details))
        await self.emitter.emit(ThreadLifecycle(phase="errored"))
        await self.emitter.drain()
        await self._finish("errored", None)
        return "errored"

    async def _model_spec(self) -> str | None:
        if self.job.model:
            return self.job.model
        async with self.ctx.sessions() as session:
            task = await session.get(Task, self.job.task_id)
        return (task.model if task else None) or self.ctx.default_model

    async def _mark_running(self) -> None:
        async with self.ctx.sessions.begin() as session:
            await session.execute(
                update(Turn).where(Turn.id == self.job.turn_id).values(status="running")
            )

    async def _store(self, role: str, content: dict[str, Any]) -> None:
        async with self.ctx.sessions.begin() as session:
            session.add(
                Message(
                    task_id=self.job.task_id,
                    turn_id=self.job.turn_id,
                    position=self.position,
                    role=role,
                    content=content,
                )
            )
        self.position += 1

    async def _finish(self, status: str, stop_reason: str | None) -> None:
        if self.used_tools and self.ctx.tools is not None:
            # The watchdog: no process a tool started outlives its turn.
            await self.ctx.tools.turn_ended(self.job.task_id)
        async with self.ctx.sessions.begin() as session:
            await session.execute(
                update(Turn)
                .where(Turn.id == self.job.turn_id)
                .values(status=status, stop_reason=stop_reason, finished_at=datetime.now(UTC))
            )
