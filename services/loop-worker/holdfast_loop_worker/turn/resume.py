"""Continuing a turn another run began: what it logged after its last snapshot.

A continued turn first emits ``turn_resumed``. If the step that was cut off
had emitted model output (a call's partial deltas), ``turn_resumed`` names it
(``discard_from_seq``..``discard_to_seq``) and the step runs again; tool
results, questions and steers logged since are remembered (``Seen``) so they
are not sent twice. A turn whose terminal event is logged already only
records its end.
"""

from __future__ import annotations

from holdfast_shared.eventlog import LoggedEvent
from holdfast_shared.events import (
    TERMINAL_PHASES,
    Event,
    HitlRequest,
    HitlResolved,
    SubagentCompleted,
    SubagentStarted,
    ThreadLifecycle,
    ToolResult,
    TurnResumed,
    Usage,
    UserMessage,
    parse_event,
    turn_of,
)
from holdfast_shared.jobs import ToolOutcome

from holdfast_loop_worker.subagents import ChildEnd
from holdfast_loop_worker.turn.delegation import usage_counts
from holdfast_loop_worker.turn.handle import ResumingTurn, Seen, SubagentsSeen

# What a model call emits; after the last snapshot, these belong to a call
# that was cut off.
_MODEL_OUTPUT = frozenset(
    {"content_block_start", "content_block_stop", "text_delta", "thinking_delta", "tool_call"}
)


async def announce_resume(turn: ResumingTurn, reason: str | None) -> None:
    """Emit ``turn_resumed``, naming the cut-off step's events to discard."""
    async for page in turn.events_after(turn.state.last_seq):
        for logged in page:
            if turn_of(logged.data) == turn.job.turn_id:
                _note(turn.seen, logged)
    turn.state.subagent_usage.update(turn.seen.subagent_usage)
    if turn.seen.terminal:
        return  # it ended already: the conductor only records that
    first, last = turn.seen.first_seq, turn.seen.last_seq
    if first is not None:
        # A model call was cut off mid-stream (its output is all that a step
        # emits besides tool results and questions, which are tracked): it runs
        # again, and its partial output is marked so a client can drop it.
        await turn.emit(
            TurnResumed(reason=reason or "resumed", discard_from_seq=first, discard_to_seq=last)
        )
    else:
        await turn.emit(TurnResumed(reason=reason or "resumed"))


def _note(seen: Seen, logged: LoggedEvent) -> None:
    event = parse_event(logged.data)
    if event.subagent is not None:
        # A child's event mirrored by a delegate call (delegation.py): none of
        # this turn's own output, questions or results.
        _note_subagent(seen, event)
        return
    if logged.type in _MODEL_OUTPUT:
        seen.first_seq = seen.first_seq or logged.seq
        seen.last_seq = logged.seq
    if isinstance(event, ToolResult):
        seen.tool_results[event.tool_call_id] = ToolOutcome(output=event.output, error=event.error)
    elif isinstance(event, HitlRequest):
        seen.hitl_requests.add(event.request_id)
    elif isinstance(event, HitlResolved):
        seen.hitl_resolved.add(event.request_id)
    elif isinstance(event, UserMessage):
        seen.steers.add(event.message_id)
    elif isinstance(event, ThreadLifecycle) and event.phase in TERMINAL_PHASES:
        seen.terminal = True
        seen.terminal_stop_reason = event.stop_reason
        seen.terminal_status = "cancelled" if event.stop_reason == "cancelled" else event.phase


def _note_subagent(seen: Seen, event: Event) -> None:
    origin = event.subagent
    assert origin is not None
    child = seen.subagents.setdefault(origin.tool_call_id, SubagentsSeen())
    if isinstance(event, SubagentStarted):
        child.started = True
    elif isinstance(event, SubagentCompleted):
        child.end = ChildEnd(event.status, event.stop_reason, event.answer)
    elif origin.seq is not None:
        child.started = True
        child.cursor = max(child.cursor, origin.seq)
        if isinstance(event, Usage):
            seen.subagent_usage[origin.task_id] = usage_counts(event.model_dump())
