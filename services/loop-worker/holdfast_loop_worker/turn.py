"""Run one turn: model iterations until a stop condition, every step as an event.

Event order for a plain answer (the gateway already logged ``started``)::

    content_block_start → text_delta… → content_block_stop → usage
    → thread_lifecycle completed (stop_reason)

A failure ends the turn with an ``error`` event and ``thread_lifecycle``
``errored``; the task stays usable for its next message either way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from holdfast_shared.conversation import load_history
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
    Usage,
)
from holdfast_shared.jobs import TurnJob
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_loop_worker.emitter import Emitter
from holdfast_loop_worker.providers import (
    BlockStart,
    BlockStop,
    Finish,
    ModelRequest,
    ProviderError,
    ProviderRegistry,
    TextChunk,
    ThinkingChunk,
    ToolInputChunk,
    UnknownModel,
    UsageReport,
)

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful agent running on Holdfast."


@dataclass
class TurnContext:
    """What every turn needs; built once per worker process."""

    sessions: async_sessionmaker[AsyncSession]
    eventlog: EventLog
    providers: ProviderRegistry
    default_model: str | None
    max_iterations: int


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
    tool_name: str | None = None
    tool_call_id: str | None = None
    partial_json: list[str] = field(default_factory=list)

    def to_content(self) -> dict[str, Any]:
        if self.block_type == "tool_use":
            raw = "".join(self.partial_json)
            return {
                "type": "tool_use",
                "id": self.tool_call_id,
                "name": self.tool_name,
                "input": json.loads(raw) if raw else {},
            }
        block: dict[str, Any] = {"type": self.block_type, "text": self.text}
        if self.signature:
            block["signature"] = self.signature
        return block


class TurnRunner:
    """Runs one :class:`TurnJob` to a terminal lifecycle event."""

    def __init__(self, ctx: TurnContext, job: TurnJob) -> None:
        self.ctx = ctx
        self.job = job
        self.emitter = Emitter(ctx.eventlog, job.task_id, job.turn_id)
        self.usage = _UsageTotals()

    async def run(self) -> str:
        """Run the turn; returns the final status (``completed`` or ``errored``)."""
        try:
            stop_reason = await self._iterate()
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
        await self._mark_running()
        async with self.ctx.sessions() as session:
            history = await load_history(session, self.job.task_id)
        request = ModelRequest(model=choice.model, system=SYSTEM_PROMPT, messages=tuple(history))
        blocks, stop_reason = await self._model_call(choice.provider.stream(request))
        # One model call per turn until tools exist: a ``tool_use`` stop ends
        # the turn with that stop reason (tool results arrive with the
        # tool-runner, which turns this into a loop bounded by max_iterations).
        content = {"blocks": [b.to_content() for b in blocks], "stop_reason": stop_reason}
        await self._store_assistant(1, content)
        return stop_reason

    async def _model_call(self, stream: Any) -> tuple[list[_Block], str]:
        blocks: dict[int, _Block] = {}
        stop_reason = "end_turn"
        emit = self.emitter.emit
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
                await emit(ContentBlockStart(block_index=item.index, block_type=item.block_type))
            elif isinstance(item, BlockStop):
                block = blocks[item.index]
                block.signature = item.signature
                await emit(ContentBlockStop(block_index=item.index, block_type=block.block_type))  # type: ignore[arg-type]
            elif isinstance(item, UsageReport):
                self.usage.add(item)
            elif isinstance(item, Finish):
                stop_reason = item.stop_reason
        return [blocks[i] for i in sorted(blocks)], stop_reason

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

    async def _store_assistant(self, position: int, content: dict[str, Any]) -> None:
        async with self.ctx.sessions.begin() as session:
            session.add(
                Message(
                    task_id=self.job.task_id,
                    turn_id=self.job.turn_id,
                    position=position,
                    role="assistant",
                    content=content,
                )
            )

    async def _finish(self, status: str, stop_reason: str | None) -> None:
        async with self.ctx.sessions.begin() as session:
            await session.execute(
                update(Turn)
                .where(Turn.id == self.job.turn_id)
                .values(status=status, stop_reason=stop_reason, finished_at=datetime.now(UTC))
            )
