"""The tool step: the model's tool calls, routed by one table, their results
sent back as the next message.

:data:`ROUTES` is where a tool name decides who answers the call: the loop
itself (``ask_user``, ``working_memory``), the turn's skills (``skill``), the
memory (``memory_search``, ``memory_save``), a subagent's child task
(``delegate``: ``delegation.py``; a response's delegate calls run at once,
before the others, up to ``HOLDFAST_MAX_SUBAGENTS_PER_TURN``), or a
tool-runner (every other name: the sandbox's built-ins and the Asset
Directory servers' tools). Before
any route, a call must name a tool the agent has; a route marked ``policed``
asks the agent's permission policy first (``allow``, ``ask``: a prompt to the
user, ``deny``). A tool-runner call whose outcome stays unknown (an effectful
one: ``toolcalls.py`` runs the others again) is settled by a person
(``hitl.settle_unknown``) before the model sees its one result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import quote

from holdfast_shared.assets import ServerTool
from holdfast_shared.events import Artifact, ToolResult
from holdfast_shared.jobs import ToolOutcome, WorkspaceFile
from holdfast_shared.tools import (
    ASK_USER,
    DELEGATE,
    MEMORY_SAVE,
    MEMORY_SEARCH,
    SKILL,
    WORKING_MEMORY,
)

from holdfast_loop_worker.turn.delegation import delegate
from holdfast_loop_worker.turn.handle import ToolTurn, cut_by_pause
from holdfast_loop_worker.turn.hitl import ask_user, permission, settle_unknown
from holdfast_loop_worker.turn_state import PendingCall


class Route(StrEnum):
    ASK_USER = "ask_user"
    WORKING_MEMORY = "working_memory"
    SKILL = "skill"
    MEMORY_SEARCH = "memory_search"
    MEMORY_SAVE = "memory_save"
    DELEGATE = "delegate"
    TOOL_RUNNER = "tool_runner"


@dataclass(frozen=True, slots=True)
class Routing:
    route: Route
    # The agent's permission policy is asked first.
    policed: bool
    # The outcome (or its effect: working memory, a saved fact, a skill's
    # sub-call usage) only a snapshot keeps, so each call is snapshotted. A
    # tool-runner's outcome is its ``tool_results`` row (or a refusal the
    # policy gives again), which a resumed turn reads back instead: one
    # snapshot after the batch does.
    snapshot_each: bool


ROUTES: Mapping[str, Routing] = {
    ASK_USER.name: Routing(Route.ASK_USER, policed=False, snapshot_each=True),
    WORKING_MEMORY.name: Routing(Route.WORKING_MEMORY, policed=False, snapshot_each=True),
    SKILL.name: Routing(Route.SKILL, policed=True, snapshot_each=True),
    MEMORY_SEARCH.name: Routing(Route.MEMORY_SEARCH, policed=True, snapshot_each=True),
    MEMORY_SAVE.name: Routing(Route.MEMORY_SAVE, policed=True, snapshot_each=True),
    # Its child task keeps the outcome, and what it mirrored is in the log
    # (resume.py reads it back): nothing for a snapshot to add.
    DELEGATE.name: Routing(Route.DELEGATE, policed=True, snapshot_each=False),
}
# Every other name: the sandbox's built-ins and the Asset Directory servers' tools.
TOOL_RUNNER = Routing(Route.TOOL_RUNNER, policed=True, snapshot_each=False)


def routing_of(name: str) -> Routing:
    return ROUTES.get(name, TOOL_RUNNER)


_Handler = Callable[[ToolTurn, PendingCall, ServerTool | None], Awaitable[ToolOutcome]]


async def _ask_user(turn: ToolTurn, call: PendingCall, _: ServerTool | None) -> ToolOutcome:
    return await ask_user(turn, call)


async def _working_memory(turn: ToolTurn, call: PendingCall, _: ServerTool | None) -> ToolOutcome:
    return await turn.working_memory(call.input)


async def _skill(turn: ToolTurn, call: PendingCall, _: ServerTool | None) -> ToolOutcome:
    return await turn.skill(call.input)


async def _memory_search(turn: ToolTurn, call: PendingCall, _: ServerTool | None) -> ToolOutcome:
    return await turn.memory_search(call.input)


async def _memory_save(turn: ToolTurn, call: PendingCall, _: ServerTool | None) -> ToolOutcome:
    return await turn.memory_save(call.input)


async def _delegate(turn: ToolTurn, call: PendingCall, _: ServerTool | None) -> ToolOutcome:
    return await delegate(turn, call)


async def _tool_runner(
    turn: ToolTurn, call: PendingCall, server_tool: ServerTool | None
) -> ToolOutcome:
    outcome = await turn.run_tool(call, server_tool)
    if outcome.unknown is not None:
        # Effectful (the caller retries the others itself): a person says what happened.
        return await settle_unknown(turn, call, server_tool, outcome)
    return outcome


_HANDLERS: Mapping[Route, _Handler] = {
    Route.ASK_USER: _ask_user,
    Route.WORKING_MEMORY: _working_memory,
    Route.SKILL: _skill,
    Route.MEMORY_SEARCH: _memory_search,
    Route.MEMORY_SAVE: _memory_save,
    Route.DELEGATE: _delegate,
    Route.TOOL_RUNNER: _tool_runner,
}


def artifact(task_name: str, tool_call_id: str, published: WorkspaceFile) -> Artifact:
    """The event of a file a tool call wrote under ``outputs/``, with its download path."""
    return Artifact(
        tool_call_id=tool_call_id,
        path=published.path,
        name=published.path.rsplit("/", 1)[-1],
        size=published.size,
        sha256=published.sha256 or "",
        download=f"/tasks/{quote(task_name, safe='')}/files/{quote(published.path)}",
    )


async def run_tools(turn: ToolTurn) -> None:
    """Run the pending calls not run yet, then store their results as one message."""
    state = turn.state
    delegations = [c for c in state.pending if c.outcome is None and c.name == DELEGATE.name]
    if delegations:
        await _run_at_once(turn, delegations)
    for call in state.pending:
        if call.outcome is None:
            outcome = await _logged_or_run(turn, call)
            call.outcome = outcome.model_dump()
            if routing_of(call.name).snapshot_each:
                await turn.snapshot("tool_result")
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
    message = turn.message("user", {"blocks": results})
    state.stage = "model"
    state.pending = []
    await turn.snapshot("tool_results", message=message)


async def _run_at_once(turn: ToolTurn, calls: list[PendingCall]) -> None:
    """``calls`` side by side, at most ``turn.max_subagents`` at a time.

    A pause cuts the wait short (the children pause too, reached by the
    gateway): the turn parks at the step's start, and on resume each call
    finds its child and goes on from the last event it mirrored (``resume.py``)
    or, ended meanwhile, from its logged end."""
    limit = asyncio.Semaphore(turn.max_subagents)

    async def one(call: PendingCall) -> None:
        async with limit:
            outcome = await _logged_or_run(turn, call)
        call.outcome = outcome.model_dump()

    with cut_by_pause(turn):
        async with asyncio.TaskGroup() as group:
            for call in calls:
                group.create_task(one(call))


async def _logged_or_run(turn: ToolTurn, call: PendingCall) -> ToolOutcome:
    """The call's result as logged, once: a tool-runner call whose result a
    cut-off run logged keeps it; any other call is answered by its route (a
    route whose effect only a snapshot keeps runs again, as it must)."""
    logged = turn.seen.tool_results.get(call.id)
    if logged is not None and routing_of(call.name).route is Route.TOOL_RUNNER:
        # The client was shown this result, maybe one a person settled: the
        # call's row may say otherwise by now (a stalled runner that finished
        # after it was given up for lost), and the model must be told what the
        # client saw.
        return logged
    outcome = await call_outcome(turn, call)
    if logged is None:
        await turn.emit(
            ToolResult(tool_call_id=call.id, output=outcome.output, error=outcome.error)
        )
        for published in outcome.artifacts:
            await turn.emit(artifact(turn.task_name, call.id, published))
    return outcome


async def call_outcome(turn: ToolTurn, call: PendingCall) -> ToolOutcome:
    """What the model is told of one call: run by its route, or refused."""
    if not turn.tools_available:
        return ToolOutcome(error="tools are not available on this engine")
    server_tool = turn.server_tool(call.name)
    if server_tool is None and not turn.agent_has_tool(call.name):
        return ToolOutcome(error=f"unknown tool {call.name!r}")
    routing = routing_of(call.name)
    if routing.policed:
        refusal = await _refusal(turn, call, server_tool)
        if refusal is not None:
            return refusal
    return await _HANDLERS[routing.route](turn, call, server_tool)


async def _refusal(
    turn: ToolTurn, call: PendingCall, server_tool: ServerTool | None
) -> ToolOutcome | None:
    """None when the policy (or the user it asks) allows the call."""
    rule = turn.tool_policy(call.name, server_tool)
    if rule == "unknown":
        return ToolOutcome(error=f"unknown tool {call.name!r}")
    if rule == "deny":
        return ToolOutcome(error=f"permission denied: the policy does not allow {call.name!r}")
    if rule == "ask":
        return await permission(turn, call)
    return None
