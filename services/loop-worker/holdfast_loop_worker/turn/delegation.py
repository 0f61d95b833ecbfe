"""The ``delegate`` tool: a subagent works in a child task, its events
mirrored into this turn's stream, its final answer the call's result.

One call, one child (``subagents.py`` starts it, or finds the one an earlier
run of the call started). Between ``subagent_started`` and
``subagent_completed`` each of the child's events is logged again in this
task's log — under this task's seq, so a client following only the parent
gets everything in one order, gapless, and a replay from any cursor gives the
same interleaving — with ``subagent`` saying where it came from:
``task_id``/``agent``/``depth`` of the task it was born in (a grandchild's
event keeps the grandchild's), ``tool_call_id`` the call of this turn it came
through and ``seq`` its seq in that call's child's log.

A turn resumed on another worker reads what it had mirrored after its last
snapshot (``resume.py`` notes it in :class:`SubagentsSeen`) and goes on from
the next child event: none is lost or mirrored twice. The child's
``thread_lifecycle`` events are not mirrored (the pair above stands for
them: a client ends its stream on a terminal ``thread_lifecycle`` of the
turn). Several delegate calls of one response run at once, up to
``HOLDFAST_MAX_SUBAGENTS_PER_TURN`` (``tool_step.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from holdfast_shared.events import (
    ENVELOPE_FIELDS,
    TERMINAL_PHASES,
    USAGE_COUNTS,
    ErrorEvent,
    SubagentCompleted,
    SubagentOrigin,
    SubagentStarted,
    ThreadLifecycle,
    Usage,
)
from holdfast_shared.jobs import ToolOutcome
from holdfast_shared.tenantturns import AtTurnLimit
from holdfast_shared.tools import MAX_DELEGATED_PATHS

from holdfast_loop_worker.subagents import (
    Child,
    ChildEnd,
    DepthExceeded,
    FilesNotCopied,
    NotAChild,
)
from holdfast_loop_worker.turn.handle import SubagentsSeen, ToolTurn
from holdfast_loop_worker.turn_state import PendingCall


async def delegate(turn: ToolTurn, call: PendingCall) -> ToolOutcome:
    agent, brief = call.input.get("agent"), call.input.get("brief")
    if not isinstance(agent, str) or agent not in turn.subagent_names:
        names = ", ".join(turn.subagent_names) or "none"
        return ToolOutcome(error=f"unknown subagent {agent!r}; yours: {names}")
    if not isinstance(brief, str) or not brief.strip():
        return ToolOutcome(error="the brief is empty: say what the subagent should do")
    files = call.input.get("files") or []
    if not isinstance(files, list) or not all(isinstance(f, str) and f for f in files):
        return ToolOutcome(error="files is a list of paths in your workspace")
    if len(files) > MAX_DELEGATED_PATHS:
        return ToolOutcome(
            error=f"files names {len(files)} paths; a delegate call copies at most "
            f"{MAX_DELEGATED_PATHS} (name a directory to copy what it holds)"
        )
    try:
        child = await turn.start_child(agent, brief, call.id, [f.strip("/") for f in files])
    except (DepthExceeded, FilesNotCopied) as exc:
        return ToolOutcome(error=str(exc))
    except AtTurnLimit as exc:
        return ToolOutcome(
            error=f"no subagent started: {exc}. Do the work yourself, or delegate it later"
        )
    except NotAChild as exc:
        return ToolOutcome(error=f"the task {exc} is not this call's subagent")
    seen = turn.seen.subagents.get(call.id) or SubagentsSeen()
    end = seen.end
    if end is None:
        origin = SubagentOrigin(
            task_id=child.name, agent=agent, depth=child.depth, tool_call_id=call.id
        )
        if not seen.started:
            await turn.emit(SubagentStarted(brief=brief, subagent=origin))
        last = await _mirror(turn, child, origin, seen.cursor)
        answer = await turn.child_answer(child)
        status = "cancelled" if last.stop_reason == "cancelled" else last.phase
        end = ChildEnd(status, last.stop_reason, answer or last.error)
        await turn.emit(
            SubagentCompleted(
                status=end.status, stop_reason=end.stop_reason, answer=end.answer, subagent=origin
            )
        )
    if end.status == "errored":
        return ToolOutcome(error=f"the subagent {agent} failed: {end.answer or 'no answer'}")
    if end.status == "cancelled":
        return ToolOutcome(error=f"the subagent {agent} was cancelled", output=end.answer or None)
    return ToolOutcome(output=end.answer)


@dataclass(frozen=True, slots=True)
class _Last:
    phase: str
    stop_reason: str | None
    # The child's last error's message, for an answer it never gave.
    error: str


def usage_counts(usage: Mapping[str, Any]) -> dict[str, int]:
    """A child's ``usage`` event's token counts (its wire fields), as the
    parent's usage names them."""
    return {name: value for name in USAGE_COUNTS if (value := usage.get(name))}


async def _mirror(turn: ToolTurn, child: Child, origin: SubagentOrigin, after: int) -> _Last:
    """Log the child's events after ``after`` in this turn's log, up to its turn's end.

    Each is rewritten as JSON, not parsed into its model: the child's log holds
    what the engine wrote, and the mirror keeps up with a child streaming at
    full speed only without a validation and a serialisation per event.
    """
    error = ""
    came_through = origin.model_dump(exclude_none=True)
    async for page in turn.child_events(child, after):
        for logged in page:
            event: dict[str, Any] = orjson.loads(logged.data)
            kind = event["type"]
            if kind == ThreadLifecycle.model_fields["type"].default:
                if event.get("turn_id") == child.turn_id and event["phase"] in TERMINAL_PHASES:
                    return _Last(event["phase"], event.get("stop_reason"), error)
                continue
            born = event.get("subagent")
            if kind == ErrorEvent.model_fields["type"].default and born is None:
                error = f"{event['error']}: {event['message']}"
            if born is None:
                born = came_through
            if kind == Usage.model_fields["type"].default:
                turn.state.subagent_usage[born["task_id"]] = usage_counts(event)
            body = {k: v for k, v in event.items() if k not in ENVELOPE_FIELDS}
            body["subagent"] = {**born, "tool_call_id": origin.tool_call_id, "seq": logged.seq}
            await turn.emit_body(kind, orjson.dumps(body).decode())
    raise AssertionError("a child's events end only with its turn's end")
