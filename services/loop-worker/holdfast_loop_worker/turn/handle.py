"""The turn's handle: all a step (and ``executions.py``) may reach of a running turn.

Steps take a :class:`TurnHandle` (or the protocol naming the few extra
collaborators of that step), never the conductor: they emit, snapshot, ask the
user, call tools and requeue through it, and reach Redis and PostgreSQL only
that way — so a step runs in a unit test against a small in-memory handle
(``tests/loop_worker/fake_turn.py``), no servers. ``live.py`` holds the
engine's implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from holdfast_shared.assets import ServerTool
from holdfast_shared.eventlog import LoggedEvent
from holdfast_shared.events import _Event
from holdfast_shared.jobs import ToolOutcome, TurnJob
from holdfast_shared.providers import ModelChoice
from sqlalchemy import Executable
from sqlalchemy.dialects.postgresql import Insert

from holdfast_loop_worker import executions
from holdfast_loop_worker.blocks import StreamBlocks
from holdfast_loop_worker.context.assembly import Assembled
from holdfast_loop_worker.context.budget import Overflow
from holdfast_loop_worker.hitl import Answer, Kind, Question
from holdfast_loop_worker.steering import Steer
from holdfast_loop_worker.stopping import TurnStop
from holdfast_loop_worker.subagents import Child, ChildEnd
from holdfast_loop_worker.trajectory import TurnEnding
from holdfast_loop_worker.turn_state import PendingCall, TurnState


@dataclass
class SubagentsSeen:
    """One delegate call's child, as this turn's log shows it after the last snapshot."""

    started: bool = False
    # The child's last seq mirrored (0: none).
    cursor: int = 0
    # Its ``subagent_completed``, once logged: the call's result is decided.
    end: ChildEnd | None = None


@dataclass
class Seen:
    """Events of this turn logged after the last snapshot (read when resuming)."""

    first_seq: int | None = None
    last_seq: int | None = None
    terminal: bool = False
    terminal_status: str = "completed"
    terminal_stop_reason: str | None = None
    # Each logged tool result, by call id: what the client was shown.
    tool_results: dict[str, ToolOutcome] = field(default_factory=dict)
    hitl_requests: set[str] = field(default_factory=set)
    hitl_resolved: set[str] = field(default_factory=set)
    # Steering messages whose user_message event is logged already.
    steers: set[str] = field(default_factory=set)
    # Delegate calls' children, by call id (turn/delegation.py).
    subagents: dict[str, SubagentsSeen] = field(default_factory=dict)
    # Their usage events' counts, by the task each was born in.
    subagent_usage: dict[str, dict[str, int]] = field(default_factory=dict)


class TurnHandle(Protocol):
    """A running turn, as its steps see it: what every step may use. A step that
    needs more says so with one of the protocols below, each this one plus the
    few collaborators of that step."""

    job: TurnJob
    state: TurnState
    seen: Seen
    stop: TurnStop
    execution: executions.ExecutionRun | None
    # Inside a wait a pause cuts short (a model call's stream, the wait for
    # subagents): see :func:`cut_by_pause`.
    streaming: bool
    # A pause published while no such wait ran: the next one is cut as it starts.
    pause_pending: bool
    # The usage totals last sent as an event by this worker.
    reported_usage: dict[str, int] | None
    # The JSON Schema the turn's answer must meet (``output_schema``), if any.
    output_schema: dict[str, Any] | None

    @property
    def task_name(self) -> str: ...
    @property
    def pausable(self) -> bool:
        """An execution's turn or a subagent's: a pause request may reach it."""

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


@contextmanager
def cut_by_pause(turn: TurnHandle) -> Iterator[None]:
    """A wait a pause cuts short instead of awaiting it (the pause listener's
    ``interrupt_for_pause`` stops the turn while ``streaming`` is set). Set and
    cleared with no await between it and the wait, so the cut lands inside it;
    a pause published just before (``pause_pending``) cuts it as it starts."""
    turn.streaming = True
    if turn.pause_pending:
        turn.stop.request("pause")
    try:
        yield
    finally:
        turn.streaming = False


class ModelTurn(TurnHandle, Protocol):
    """The model step's (model_step.py)."""

    # The blocks of the model call under way or cut off, if any (a cancel or a
    # deadline closes them); None once a call completed.
    stream: StreamBlocks | None

    @property
    def retry_attempts(self) -> int: ...
    async def prepare(
        self, choice: ModelChoice, *, harder: bool = False, overflow: Overflow | None = None
    ) -> Assembled: ...
    # A model call under way on its endpoint, while the block runs (the
    # learning centre yields to it: holdfast_shared.endpoint_calls).
    def calling_model(self, choice: ModelChoice) -> AbstractAsyncContextManager[None]: ...
    # A call stopped by the server's window ("length" well short of the
    # max_tokens asked) at about ``tokens``: the window to assume from now on.
    def window_filled(self, choice: ModelChoice, tokens: int) -> None: ...
    # The model answered a prompt of ``tokens`` (estimated); the largest it
    # answered so far (0: none), which no window learned later undercuts.
    def prompt_answered(self, choice: ModelChoice, tokens: int) -> None: ...
    def largest_answered(self, choice: ModelChoice) -> int: ...
    async def pending_steers(self) -> list[Steer]: ...
    # The task's last logged seq, once every event emitted so far is logged:
    # where a retried model call's discarded output begins and ends.
    async def logged_seq(self) -> int: ...


class AskingTurn(TurnHandle, Protocol):
    """Questions to the user (hitl.py)."""

    async def open_question(
        self,
        kind: Kind,
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
    async def run_tool(
        self, call: PendingCall, server_tool: ServerTool | None, *, attempt: int = 1
    ) -> ToolOutcome: ...
    async def working_memory(self, tool_input: Mapping[str, Any]) -> ToolOutcome: ...
    async def memory_search(self, tool_input: Mapping[str, Any]) -> ToolOutcome: ...
    async def memory_save(self, tool_input: Mapping[str, Any]) -> ToolOutcome: ...
    async def skill(self, tool_input: dict[str, Any]) -> ToolOutcome: ...
    # The delegate route (delegation.py).
    @property
    def subagent_names(self) -> tuple[str, ...]: ...
    @property
    def max_subagents(self) -> int: ...
    async def start_child(
        self, agent: str, brief: str, tool_call_id: str, files: Sequence[str]
    ) -> Child:
        """The call's child task with ``files`` copied into its workspace, started
        or found (DepthExceeded past the limit, FilesNotCopied)."""

    def child_events(self, child: Child, after_seq: int) -> AsyncIterator[list[LoggedEvent]]: ...
    async def emit_body(self, event_type: str, body: str) -> None:
        """Emit an event already serialised without its envelope (a mirrored one)."""

    async def child_answer(self, child: Child) -> str:
        """The text of the child's last assistant message ("" when none)."""


class ParkingTurn(AskingTurn, Protocol):
    """Letting go of the turn without ending it (parking.py)."""

    async def keep_task_while_parked(self) -> None: ...
    async def release_lease(self, *, status: str | None = None) -> None: ...
    async def stop_tools(self) -> None:
        """Kill what the task's tools run (its stdio MCP servers too), on every runner."""


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
    async def stop_children(self) -> None:
        """Cancel the turns of the subagents it started that are still under way."""
