"""An in-memory :class:`~holdfast_loop_worker.turn.handle.TurnHandle` (with every
step's protocol) for unit tests of the turn's steps: no Redis, no PostgreSQL,
no mock of either.

It records what a step did through the handle (events, snapshots, stored
messages, collaborator calls, requeued jobs), and answers the way a test
set it up (the policy's rule per tool, the user's answers, tool outcomes).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from holdfast_loop_worker.blocks import StreamBlocks
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.executions import ExecutionRun
from holdfast_loop_worker.hitl import Answer, Kind, Question
from holdfast_loop_worker.steering import Steer
from holdfast_loop_worker.stopping import TurnStop
from holdfast_loop_worker.subagents import Child
from holdfast_loop_worker.trajectory import TurnEnding
from holdfast_loop_worker.turn.handle import (
    EndingTurn,
    ModelTurn,
    ParkingTurn,
    ResumingTurn,
    Seen,
    ToolTurn,
)
from holdfast_loop_worker.turn_state import PendingCall, TurnState
from holdfast_shared.assets import ServerTool
from holdfast_shared.db.models import Message
from holdfast_shared.eventlog import LoggedEvent
from holdfast_shared.events import _Event
from holdfast_shared.jobs import ToolOutcome, TurnJob
from holdfast_shared.providers import ModelChoice
from sqlalchemy import Executable
from sqlalchemy.dialects.postgresql import Insert, insert


@dataclass
class FakeTurn:
    """A turn in memory. ``calls`` lists the collaborators a step reached, in order."""

    job: TurnJob = field(
        default_factory=lambda: TurnJob(task_id="task_1", turn_id="turn_1", tenant_id="t1")
    )
    state: TurnState = field(default_factory=TurnState)
    seen: Seen = field(default_factory=Seen)
    stop: TurnStop = field(default_factory=TurnStop)
    execution: ExecutionRun | None = None
    stream: StreamBlocks | None = None
    streaming: bool = False
    pause_pending: bool = False
    reported_usage: dict[str, int] | None = None
    output_schema: dict[str, Any] | None = None
    resuming: bool = False
    # Set up by the test.
    agent_tools: tuple[str, ...] = ()
    server_tools: dict[str, ServerTool] = field(default_factory=dict)
    tools: bool = True
    rules: dict[str, str] = field(default_factory=dict)  # tool -> allow|ask|deny|unknown
    answers: dict[str, Answer] = field(default_factory=dict)  # request id -> answer
    # What the tool-runner answers, attempt after attempt (else: it ran).
    tool_outcomes: list[ToolOutcome] = field(default_factory=list)
    cancel_flag: bool = False
    # The largest prompt the model answered (prompt_answered).
    answered: int = 0
    # Recorded.
    events: list[_Event] = field(default_factory=list)
    snapshots: list[str] = field(default_factory=list)
    stored: list[dict[str, Any]] = field(default_factory=list)
    messages: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    requeued: list[TurnJob] = field(default_factory=list)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)

    @property
    def pausable(self) -> bool:
        return self.execution is not None

    @property
    def task_name(self) -> str:
        return self.job.task_id

    @property
    def provider_name(self) -> str | None:
        return "scripted"

    @property
    def model_label(self) -> str | None:
        return "scripted:echo"

    async def emit(self, event: _Event) -> None:
        self.events.append(event)

    async def snapshot(
        self,
        reason: str,
        *,
        advance: bool = True,
        message: Insert | None = None,
        statements: Sequence[Executable] = (),
    ) -> None:
        self.snapshots.append(reason)

    def message(self, role: str, content: dict[str, Any]) -> Insert:
        self.messages.append((role, content))
        self.state.position += 1
        return insert(Message).values(role=role, content=content)

    async def store(self, message: Insert) -> None:
        self.stored.append(self.messages[-1][1])

    async def cancel_requested(self) -> bool:
        return self.cancel_flag

    def active_ms(self) -> int:
        return self.state.active_ms

    async def requeue(self, job: TurnJob) -> None:
        self.requeued.append(job)

    def interrupt_for_pause(self) -> None:
        self.calls.append(("interrupt_for_pause", None))

    async def events_after(self, seq: int) -> AsyncIterator[list[LoggedEvent]]:
        # Nothing logged after the snapshot: a fresh resume.
        pages: list[list[LoggedEvent]] = []
        for page in pages:
            yield page

    async def keep_task_while_parked(self) -> None:
        self.calls.append(("keep_task_while_parked", None))

    async def release_lease(self, *, status: str | None = None) -> None:
        self.calls.append(("release_lease", status))

    async def stop_tools(self) -> None:
        self.calls.append(("stop_tools", None))

    def ending(
        self, status: str, stop_reason: str | None, error: dict[str, Any] | None
    ) -> TurnEnding:
        return TurnEnding(
            tenant_id=self.job.tenant_id,
            user_id="",
            task_id=self.job.task_id,
            task_name=None,
            turn_id=self.job.turn_id,
            agent="default",
            model=self.model_label,
            status=status,
            stop_reason=stop_reason,
            error=error,
            usage=dict(self.state.usage),
            active_ms=self.state.active_ms,
            started_at=None,
        )

    async def finish_events(self, last: list[Any]) -> None:
        self.events.extend(last)
        self.calls.append(("finish_events", len(last)))

    async def release_task(self) -> None:
        self.calls.append(("release_task", None))

    async def record_end(self, ending: TurnEnding) -> None:
        self.calls.append(("record_end", (ending.status, ending.stop_reason, ending.error)))

    async def end_execution(self, status: str, last: list[Any]) -> None:
        self.calls.append(("end_execution", status))

    async def start_following(self) -> None:
        self.calls.append(("start_following", None))

    async def stop_children(self) -> None:
        self.calls.append(("stop_children", None))

    @property
    def retry_attempts(self) -> int:
        return 1

    async def prepare(
        self, choice: ModelChoice, *, harder: bool = False, overflow: Any = None
    ) -> Assembled:
        raise NotImplementedError("model calls are tested with the scripted provider")

    def calling_model(self, choice: ModelChoice) -> AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    def window_filled(self, choice: ModelChoice, tokens: int) -> None:
        self.calls.append(("window_filled", tokens))

    def prompt_answered(self, choice: ModelChoice, tokens: int) -> None:
        self.answered = max(self.answered, tokens)

    def largest_answered(self, choice: ModelChoice) -> int:
        return self.answered

    async def pending_steers(self) -> list[Steer]:
        return []

    async def logged_seq(self) -> int:
        return len(self.events)

    async def open_question(
        self,
        kind: Kind,
        text: str,
        tool_call: dict[str, Any] | None,
    ) -> Question:
        question = Question(f"hitl_{len(self.questions) + 1}", kind, text, tool_call, 0)
        self.questions.append(question)
        return question

    async def read_question(self, request_id: str) -> tuple[Question, Answer]:
        question = next(q for q in self.questions if q.request_id == request_id)
        return question, self.answers.get(request_id, Answer("pending"))

    @property
    def tools_available(self) -> bool:
        return self.tools

    def agent_has_tool(self, name: str) -> bool:
        return name in self.agent_tools

    def server_tool(self, name: str) -> ServerTool | None:
        return self.server_tools.get(name)

    def tool_policy(self, name: str, server_tool: ServerTool | None) -> str:
        self.calls.append(("policy", name))
        return self.rules.get(name, "allow")

    async def run_tool(
        self, call: PendingCall, server_tool: ServerTool | None, *, attempt: int = 1
    ) -> ToolOutcome:
        self.calls.append(("tool_runner", call.name) if attempt == 1 else ("retry", attempt))
        if self.tool_outcomes:
            return self.tool_outcomes.pop(0)
        return ToolOutcome(output={"ran": call.name})

    async def working_memory(self, tool_input: Mapping[str, Any]) -> ToolOutcome:
        self.calls.append(("working_memory", dict(tool_input)))
        return ToolOutcome(output={"set": "k"})

    async def memory_search(self, tool_input: Mapping[str, Any]) -> ToolOutcome:
        self.calls.append(("memory_search", dict(tool_input)))
        return ToolOutcome(output={"hits": []})

    async def memory_save(self, tool_input: Mapping[str, Any]) -> ToolOutcome:
        self.calls.append(("memory_save", dict(tool_input)))
        return ToolOutcome(output={"saved": True})

    async def skill(self, tool_input: dict[str, Any]) -> ToolOutcome:
        self.calls.append(("skill", dict(tool_input)))
        return ToolOutcome(output={"skill": tool_input.get("name")})

    # No subagents here: tests/e2e/test_subagents.py runs them on the engine.
    subagent_names: tuple[str, ...] = ()
    max_subagents = 4

    async def start_child(
        self, agent: str, brief: str, tool_call_id: str, files: Sequence[str]
    ) -> Child:
        raise AssertionError("the fake turn has no subagents")

    def child_events(self, child: Child, after_seq: int) -> AsyncIterator[list[LoggedEvent]]:
        raise AssertionError("the fake turn has no subagents")

    async def child_answer(self, child: Child) -> str:
        raise AssertionError("the fake turn has no subagents")

    async def emit_body(self, event_type: str, body: str) -> None:
        raise AssertionError("the fake turn has no subagents to mirror")


def _implements(
    turn: FakeTurn,
) -> tuple[ToolTurn, ModelTurn, ParkingTurn, ResumingTurn, EndingTurn]:
    """mypy checks here that the fake keeps up with every step's protocol."""
    return turn, turn, turn, turn, turn
