"""The tool step's one routing table (``turn/tool_step.py``), against an in-memory handle."""

from __future__ import annotations

from typing import Any

import pytest
from holdfast_loop_worker.hitl import Answer
from holdfast_loop_worker.turn import tool_step
from holdfast_loop_worker.turn.tool_step import Route, routing_of
from holdfast_loop_worker.turn_state import PendingCall
from holdfast_shared.assets import ServerTool
from holdfast_shared.errors import Parked
from holdfast_shared.events import HitlRequest, HitlResolved, ToolResult
from holdfast_shared.tools import (
    ASK_USER,
    MEMORY_SAVE,
    MEMORY_SEARCH,
    SKILL,
    WORKING_MEMORY,
    ToolSpec,
)

from tests.loop_worker.fake_turn import FakeTurn

ALL = (ASK_USER.name, WORKING_MEMORY.name, SKILL.name, MEMORY_SEARCH.name, MEMORY_SAVE.name)


def _call(name: str, tool_input: dict[str, Any] | None = None) -> PendingCall:
    return PendingCall(f"call_{name}", name, tool_input or {})


def test_every_tool_has_one_route() -> None:
    assert {name: routing_of(name).route for name in (*ALL, "bash", "github__list")} == {
        "ask_user": Route.ASK_USER,
        "working_memory": Route.WORKING_MEMORY,
        "skill": Route.SKILL,
        "memory_search": Route.MEMORY_SEARCH,
        "memory_save": Route.MEMORY_SAVE,
        "bash": Route.TOOL_RUNNER,
        "github__list": Route.TOOL_RUNNER,
    }
    # The loop's own tools skip the policy; only a tool-runner's outcome is a row.
    assert [n for n in ALL if not routing_of(n).policed] == ["ask_user", "working_memory"]
    assert [n for n in (*ALL, "bash") if not routing_of(n).snapshot_each] == ["bash"]


@pytest.mark.parametrize(
    ("name", "reached"),
    [
        ("working_memory", ["working_memory"]),
        ("skill", ["policy", "skill"]),
        ("memory_search", ["policy", "memory_search"]),
        ("memory_save", ["policy", "memory_save"]),
        ("bash", ["policy", "tool_runner"]),
    ],
)
async def test_a_call_reaches_its_route_only(name: str, reached: list[str]) -> None:
    turn = FakeTurn(agent_tools=(*ALL, "bash"))
    outcome = await tool_step.call_outcome(turn, _call(name))
    assert outcome.error is None
    assert [collaborator for collaborator, _ in turn.calls] == reached


async def test_an_asset_directory_tool_runs_on_a_tool_runner() -> None:
    spec = ToolSpec("github__list", "list the repositories", {"type": "object"})
    server = ServerTool(server="github", tool="list", spec=spec, read_only=True)
    turn = FakeTurn(server_tools={"github__list": server})
    outcome = await tool_step.call_outcome(turn, _call("github__list"))
    assert outcome.output == {"ran": "github__list"}
    assert turn.calls == [("policy", "github__list"), ("tool_runner", "github__list")]


async def test_refusals_come_before_any_route() -> None:
    no_runners = FakeTurn(agent_tools=ALL, tools=False)
    outcome = await tool_step.call_outcome(no_runners, _call("working_memory"))
    assert outcome.error == "tools are not available on this engine"
    not_the_agents = FakeTurn(agent_tools=("bash",))
    outcome = await tool_step.call_outcome(not_the_agents, _call("skill"))
    assert outcome.error == "unknown tool 'skill'"
    denied = FakeTurn(agent_tools=("bash",), rules={"bash": "deny"})
    outcome = await tool_step.call_outcome(denied, _call("bash"))
    assert outcome.error == "permission denied: the policy does not allow 'bash'"
    assert no_runners.calls == not_the_agents.calls == []
    assert denied.calls == [("policy", "bash")]


async def test_ask_parks_the_turn_until_the_user_allows() -> None:
    turn = FakeTurn(agent_tools=("bash",), rules={"bash": "ask"})
    call = _call("bash", {"command": "ls"})
    with pytest.raises(Parked):
        await tool_step.call_outcome(turn, call)
    (request,) = turn.events
    assert isinstance(request, HitlRequest) and request.kind == "permission"
    assert turn.snapshots == ["hitl"]
    turn.answers[request.request_id] = Answer("answered", "yes")
    outcome = await tool_step.call_outcome(turn, call)
    assert outcome.output == {"ran": "bash"}
    assert isinstance(turn.events[-1], HitlResolved)


async def test_ask_user_is_answered_by_the_user() -> None:
    turn = FakeTurn(agent_tools=("ask_user",))
    call = _call("ask_user", {"question": "which branch?"})
    with pytest.raises(Parked):
        await tool_step.call_outcome(turn, call)
    assert call.hitl_request is not None
    turn.answers[call.hitl_request] = Answer("answered", "main")
    outcome = await tool_step.call_outcome(turn, call)
    assert outcome.output == {"answer": "main"}
    assert [c for c, _ in turn.calls] == []  # neither the policy nor a tool-runner


async def test_the_batch_snapshots_what_only_a_snapshot_keeps() -> None:
    turn = FakeTurn(agent_tools=("bash", "working_memory"))
    turn.state.stage = "tools"
    turn.state.pending = [_call("bash"), _call("working_memory", {"key": "k", "value": "v"})]
    await tool_step.run_tools(turn)
    assert turn.snapshots == ["tool_result", "tool_results"]
    assert [type(e) for e in turn.events] == [ToolResult, ToolResult]
    role, content = turn.messages[-1]
    assert role == "user"
    assert [b["tool_use_id"] for b in content["blocks"]] == ["call_bash", "call_working_memory"]
    assert (turn.state.stage, turn.state.pending) == ("model", [])
