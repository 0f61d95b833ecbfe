"""Agents: the built-ins reach the model; a tenant's own through ``/agents``.

Black-box through real engine processes. The scripted model answers
``{"echo_request": true}`` with the system prompt, the tools and the model
of the request it got, so a turn shows which agent the engine ran.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from holdfast_gateway.tasks import find_task
from holdfast_loop_worker.toolcalls import ToolCaller
from holdfast_shared.agents import DEFAULT_AGENT, builtin_agents, model_for
from holdfast_shared.jobs import ToolCallJob
from holdfast_shared.keys import Keys
from holdfast_shared.settings import Settings
from holdfast_shared.skills import builtin_skills
from holdfast_shared.tools import BUILTIN_BY_NAME, DEFAULT_PERMISSIONS
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.processes import EngineProcesses
from tests.sse_client import Received, execute
from tests.taskids import TENANTS

pytestmark = pytest.mark.timeout(90)

ECHO = "/script " + json.dumps({"echo_request": True})
BUILTINS = ["general", "analyst", "coder", "researcher", "writer"]  # the default first


def script(*calls: dict[str, Any]) -> str:
    return "/script " + json.dumps({"text": "", "tool_calls": list(calls)})


def by_type(got: Received, event_type: str) -> list[dict[str, Any]]:
    return [e for e in got.events if e["type"] == event_type]


def new_agent(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "description": "A test agent",
        "system_prompt": f"You are {name}, a test agent. Answer in one word.",
        **fields,
    }


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60) as http:
        yield http


class Api:
    """``/agents`` as one tenant calls it."""

    def __init__(self, client: httpx.AsyncClient, base: str, key: str) -> None:
        self.client = client
        self.base = base
        self.key = key

    async def call(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return await self.client.request(
            method,
            f"{self.base}{path}",
            json=body,
            headers={"X-Engine-Key": self.key},
        )

    async def echo(self, **body: Any) -> dict[str, Any]:
        """What the model was sent, in a turn of a new task with ``body``."""
        got = await execute(self.client, self.base, self.key, {"message": ECHO, **body})
        assert got.status == 200, got.body
        assert got.events[-1]["phase"] == "completed", got.events[-3:]
        echoed: dict[str, Any] = json.loads(got.text)
        return echoed

    async def turn(self, message: str, **body: Any) -> Received:
        return await execute(self.client, self.base, self.key, {"message": message, **body})


@pytest.fixture
def main(engine: EngineProcesses, api_keys: dict[str, str], client: httpx.AsyncClient) -> Api:
    return Api(client, engine.url, api_keys["main"])


@pytest.fixture
def other(engine: EngineProcesses, api_keys: dict[str, str], client: httpx.AsyncClient) -> Api:
    return Api(client, engine.url, api_keys["other"])


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


# -- the built-ins ---------------------------------------------------------------


def test_the_builtin_agents_ship_as_considered_files() -> None:
    agents = builtin_agents()
    assert sorted(agents) == sorted(BUILTINS)
    for agent in agents.values():
        assert agent.builtin and agent.description
        # Built-in skills only, used through the skill tool.
        assert set(agent.skills) <= set(builtin_skills())
        assert ("skill" in agent.tools) == bool(agent.skills), agent.name
        # A real prompt: several paragraphs, not a line.
        assert len(agent.system_prompt) > 1500
        assert agent.system_prompt.count("\n\n") >= 4
        assert set(agent.tools) <= set(BUILTIN_BY_NAME)
        assert set(agent.permissions) == set(agent.tools)
        assert [t.name for t in agent.tool_specs()] == [
            n for n in BUILTIN_BY_NAME if n in agent.tools
        ]
        # Never network and commands that run unasked together.
        assert not (agent.network and agent.permissions.get("bash") == "allow"), agent.name
    general = agents[DEFAULT_AGENT]
    # The default keeps the engine's behaviour from before agents: every tool,
    # the default policy, no network, the engine's default model.
    assert set(general.tools) == set(BUILTIN_BY_NAME)
    assert dict(general.permissions) == {t: DEFAULT_PERMISSIONS[t] for t in general.tools}
    assert not general.network and general.model is None
    assert "bash" not in agents["writer"].tools
    assert agents["researcher"].network


def test_the_operators_settings_win_over_the_agents_own() -> None:
    settings = Settings(
        tool_permissions={"*": {"bash": "allow"}, "coder": {"bash": "deny"}},
        network_agents=["analyst"],
    )
    # The policy needs no Redis, database or inbox.
    caller = ToolCaller(
        None,
        None,
        None,
        None,
        permission=settings.permission_override,
        network_agents=frozenset(settings.network_agents),
        timeout_seconds=60,
    )
    agents = builtin_agents()
    assert caller.policy(agents["coder"], "bash") == "deny"  # the agent's entry first
    assert caller.policy(agents["general"], "bash") == "allow"  # then "*"
    assert caller.policy(agents["general"], "write_file") == "ask"  # then the agent's own
    assert caller.policy(agents["coder"], "write_file") == "allow"
    assert caller.policy(agents["writer"], "bash") == "unknown"  # not its tool
    assert caller.network(agents["researcher"]) and caller.network(agents["analyst"])
    assert not caller.network(agents["coder"])

    coder = agents["coder"]  # prefers anthropic:claude-sonnet-4-5
    served = ["scripted", "anthropic"]
    override = {"coder": "openai:gpt-4.1"}
    assert model_for(coder, requested="scripted", overrides=override, served=served) == "scripted"
    assert model_for(coder, requested=None, overrides=override, served=served) == "openai:gpt-4.1"
    assert model_for(coder, requested=None, overrides={}, served=served) == coder.model
    assert model_for(coder, requested=None, overrides={}, served=["scripted"]) is None


async def test_every_builtin_agent_runs_a_turn_as_itself(main: Api) -> None:
    listed = await main.call("GET", "/agents")
    assert listed.status_code == 200
    builtins = [a for a in listed.json()["agents"] if a["builtin"]]
    assert [a["name"] for a in builtins] == BUILTINS
    assert all("system_prompt" not in a for a in listed.json()["agents"])
    for name in BUILTINS:
        agent = builtin_agents()[name]
        echoed = await main.echo(agent=name)
        # The agent's prompt, then its skills' names and descriptions (test_skills.py).
        assert echoed["system"].startswith(agent.system_prompt), name
        assert ("# Skills" in echoed["system"]) == bool(agent.skills), name
        assert echoed["tools"] == [t.name for t in agent.tool_specs()], name
        # Its preferred provider is not served here: the engine's default model.
        assert echoed["model"] == "scripted", name
        shown = await main.call("GET", f"/agents/{name}")
        assert shown.status_code == 200
        assert shown.json()["system_prompt"] == agent.system_prompt
        assert shown.json()["builtin"] is True and shown.json()["created_at"] is None
    # No agent named: the default one.
    echoed = await main.echo()
    assert echoed["system"].startswith(builtin_agents()[DEFAULT_AGENT].system_prompt)


async def test_an_agent_without_a_tool_cannot_call_it(main: Api) -> None:
    got = await main.turn(script({"name": "bash", "input": {"command": "echo hi"}}), agent="writer")
    assert got.events[-1]["phase"] == "completed"
    result = by_type(got, "tool_result")[0]
    assert result["error"] == "unknown tool 'bash'"
    assert "hitl_request" not in got.types


# -- custom agents ----------------------------------------------------------------


async def test_a_custom_agent_is_created_read_run_replaced_and_deleted(main: Api) -> None:
    name = unique("zed")
    body = new_agent(
        name,
        model="scripted:zed-1",
        tools=["list_dir", "read_file", "list_dir"],
        permissions={"list_dir": "deny"},
    )
    created = await main.call("POST", "/agents", body)
    assert created.status_code == 201, created.text
    agent = created.json()
    assert agent["name"] == name and agent["builtin"] is False
    assert agent["system_prompt"] == body["system_prompt"]
    assert agent["tools"] == ["list_dir", "read_file"]  # once each, as given
    assert agent["permissions"] == {"list_dir": "deny", "read_file": "allow"}
    assert agent["skills"] == [] and agent["servers"] == [] and agent["network"] is False
    assert agent["model"] == "scripted:zed-1"
    assert isinstance(agent["created_at"], int) and agent["updated_at"] >= agent["created_at"]

    assert (await main.call("GET", f"/agents/{name}")).json() == agent
    listed = (await main.call("GET", "/agents")).json()["agents"]
    mine = [a for a in listed if a["name"] == name]
    assert mine == [{k: v for k, v in agent.items() if k != "system_prompt"}]

    echoed = await main.echo(agent=name)
    echoed.pop("soul")  # the tenant's brain's, whoever the agent is
    assert echoed == {
        "model": "zed-1",  # its preferred model: the scripted provider is served
        "system": body["system_prompt"],
        "tools": ["read_file", "list_dir"],  # in the catalogue's order
    }
    # Its own policy: list_dir is denied.
    got = await main.turn(script({"name": "list_dir", "input": {}}), agent=name)
    assert by_type(got, "tool_result")[0]["error"].startswith("permission denied")
    # The request's model wins over the agent's.
    assert (await main.echo(agent=name, model="scripted:other"))["model"] == "other"

    replaced = await main.call(
        "PUT",
        f"/agents/{name}",
        {"description": "Replaced", "system_prompt": "You are the new Zed."},
    )
    assert replaced.status_code == 200, replaced.text
    now = replaced.json()
    assert now["description"] == "Replaced" and now["model"] is None
    assert now["tools"] == list(builtin_agents()[DEFAULT_AGENT].tools)  # the default set
    assert now["created_at"] == agent["created_at"]
    echoed = await main.echo(agent=name)
    assert echoed["system"] == "You are the new Zed." and echoed["model"] == "scripted"

    deleted = await main.call("DELETE", f"/agents/{name}")
    assert deleted.status_code == 204 and deleted.content == b""
    for method in ("GET", "DELETE"):
        gone = await main.call(method, f"/agents/{name}")
        assert gone.status_code == 404 and gone.json()["error"] == "AGENT_NOT_FOUND"
    refused = await main.turn("hi", agent=name)
    assert refused.status == 404 and refused.body["error"] == "AGENT_NOT_FOUND"


async def test_an_unknown_agent_is_404_before_anything_is_written(
    main: Api, sessions: async_sessionmaker[AsyncSession]
) -> None:
    task_id = unique("no-agent")
    got = await main.turn("hi", agent="nobody-here", task_id=task_id)
    assert got.status == 404
    assert got.body["error"] == "AGENT_NOT_FOUND" and "nobody-here" in got.body["message"]
    async with sessions() as session:
        assert await find_task(session, TENANTS["main"], task_id) is None


@pytest.mark.parametrize(
    ("fields", "loc", "named"),
    [
        ({"tools": ["bash", "teleport"]}, ["body", "tools", "1"], "teleport"),
        (
            {"permissions": {"teleport": "allow"}},
            ["body", "permissions", "teleport", "[key]"],
            "teleport",
        ),
        ({"permissions": {"bash": "sometimes"}}, ["body", "permissions", "bash"], "allow"),
        ({"skills": ["pdf-forms"]}, ["body", "skills", "0"], "pdf-forms"),
        ({"servers": ["github"]}, ["body", "servers", "0"], "github"),
        ({"model": "nosuch:model"}, ["body", "model"], "nosuch"),
        ({"model": "openai:has space"}, ["body", "model"], "provider[:model]"),
        ({"system_prompt": ""}, ["body", "system_prompt"], "at least 1"),
        ({"description": "nul \u0000 here"}, ["body", "description"], "NUL"),
        ({"name": "two words"}, ["body", "name"], "pattern"),
        ({"colour": "blue"}, ["body", "colour"], "Extra inputs"),
        ({"network": 1}, ["body", "network"], "boolean"),
    ],
    ids=[
        "unknown-tool",
        "permission-for-unknown-tool",
        "bad-permission",
        "unknown-skill",
        "unknown-server",
        "unknown-provider",
        "malformed-model",
        "empty-prompt",
        "nul",
        "bad-name",
        "extra-field",
        "network-not-a-boolean",
    ],
)
async def test_an_invalid_agent_is_422_naming_the_field(
    main: Api, fields: dict[str, Any], loc: list[str], named: str
) -> None:
    name = unique("invalid")
    body = {**new_agent(name), **fields}
    for method, path, sent in (
        ("POST", "/agents", body),
        ("PUT", "/agents/coder-custom", {k: v for k, v in body.items() if k != "name"}),
    ):
        if method == "PUT" and "name" in fields:
            continue
        response = await main.call(method, path, sent)
        assert response.status_code == 422, response.text
        error = response.json()
        assert error["error"] == "INVALID_REQUEST"
        assert loc in [e["loc"] for e in error["details"]["errors"]], error
        assert named in error["message"], error
    assert (await main.call("GET", f"/agents/{name}")).status_code == 404


async def test_names_are_unique_and_builtins_are_fixed(main: Api) -> None:
    taken = await main.call("POST", "/agents", new_agent("general"))
    assert taken.status_code == 409 and taken.json()["error"] == "AGENT_EXISTS"
    assert "built-in" in taken.json()["message"]
    assert (await main.echo())["system"].startswith(builtin_agents()["general"].system_prompt)

    name = unique("twice")
    assert (await main.call("POST", "/agents", new_agent(name))).status_code == 201
    again = await main.call("POST", "/agents", new_agent(name, description="Another"))
    assert again.status_code == 409 and again.json()["error"] == "AGENT_EXISTS"
    assert (await main.call("GET", f"/agents/{name}")).json()["description"] == "A test agent"

    spec = {"description": "Mine now", "system_prompt": "Obey."}
    for method, body in (("PUT", spec), ("DELETE", None)):
        refused = await main.call(method, "/agents/coder", body)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"] == "AGENT_BUILTIN"
        assert "built-in" in refused.json()["message"]
    missing = await main.call("PUT", f"/agents/{unique('missing')}", spec)
    assert missing.status_code == 404 and missing.json()["error"] == "AGENT_NOT_FOUND"
    not_json = await main.client.post(
        f"{main.base}/agents",
        content=json.dumps(new_agent(unique("text"))),
        headers={"X-Engine-Key": main.key, "content-type": "text/plain"},
    )
    assert not_json.status_code == 415
    await main.call("DELETE", f"/agents/{name}")


async def test_another_tenants_agents_answer_404(main: Api, other: Api) -> None:
    name = unique("private")
    assert (await main.call("POST", "/agents", new_agent(name))).status_code == 201
    spec = {"description": "Stolen", "system_prompt": "Leak everything."}
    for method, body in (("GET", None), ("PUT", spec), ("DELETE", None)):
        response = await other.call(method, f"/agents/{name}", body)
        assert response.status_code == 404, (method, response.text)
        assert response.json()["error"] == "AGENT_NOT_FOUND"
    listed = (await other.call("GET", "/agents")).json()["agents"]
    assert name not in [a["name"] for a in listed]
    refused = await other.turn("hi", agent=name)
    assert refused.status == 404 and refused.body["error"] == "AGENT_NOT_FOUND"
    # The name is free in the other tenant: each has its own.
    theirs = await other.call("POST", "/agents", new_agent(name, system_prompt="Theirs."))
    assert theirs.status_code == 201
    assert (await other.echo(agent=name))["system"] == "Theirs."
    assert (await main.echo(agent=name))["system"] == new_agent(name)["system_prompt"]
    for api in (main, other):
        assert (await api.call("DELETE", f"/agents/{name}")).status_code == 204


async def tool_job(redis: Redis, prefix: str, tool_call_id: str) -> ToolCallJob:
    """The job the loop-worker sent the tool-runners for the call."""
    for _id, fields in await redis.xrange(Keys(prefix).tools):
        job = ToolCallJob.find(fields)
        if job is not None and job.tool_call_id == tool_call_id:
            return job
    raise AssertionError(f"no tool call job {tool_call_id}")


async def test_a_custom_agents_policy_and_network_reach_its_tools(
    main: Api, redis: Redis, redis_prefix: str
) -> None:
    online, offline = unique("online"), unique("offline")
    for name, network in ((online, True), (offline, False)):
        created = await main.call(
            "POST",
            "/agents",
            new_agent(name, tools=["bash"], permissions={"bash": "allow"}, network=network),
        )
        assert created.status_code == 201, created.text
    call = {"name": "bash", "input": {"command": "echo hi"}}
    with_network = await main.turn(script(call), agent=online)
    without = await main.turn(script(call), agent=offline)
    assert "hitl_request" not in with_network.types + without.types  # bash: allow
    # The call carries the agent's network to the runner, which builds the
    # sandbox with or without it (tool-runner; tests/sandbox test both).
    for got, network in ((with_network, True), (without, False)):
        assert "tool_result" in got.types
        job = await tool_job(redis, redis_prefix, by_type(got, "tool_call")[0]["tool_call_id"])
        assert job.tool == "bash" and job.network is network
    # Tools it does not have are refused, even the loop's own.
    got = await main.turn(
        script({"name": "ask_user", "input": {"question": "May I?"}}), agent=offline
    )
    assert by_type(got, "tool_result")[0]["error"] == "unknown tool 'ask_user'"
    for name in (online, offline):
        await main.call("DELETE", f"/agents/{name}")


async def test_a_turn_whose_agent_was_deleted_while_it_waited_fails_cleanly(
    main: Api,
) -> None:
    name = unique("fleeting")
    body = new_agent(name, tools=["bash"])  # bash asks (the default)
    assert (await main.call("POST", "/agents", body)).status_code == 201
    task_id = unique("fleeting-task")
    call = {"name": "bash", "input": {"command": "echo hi"}}
    turn = asyncio.create_task(main.turn(script(call), agent=name, task_id=task_id))
    request = None
    for _ in range(200):
        pending = (
            await main.client.get(
                f"{main.base}/hitl/pending",
                params={"task_id": task_id},
                headers={"X-Engine-Key": main.key},
            )
        ).json()["pending"]
        if pending:
            request = pending[0]
            break
        await asyncio.sleep(0.05)
    assert request is not None, "the turn never asked"
    assert (await main.call("DELETE", f"/agents/{name}")).status_code == 204
    answered = await main.call(
        "POST",
        "/hitl/respond",
        {"task_id": task_id, "request_id": request["request_id"], "answer": "yes"},
    )
    assert answered.status_code == 200, answered.text
    got = await asyncio.wait_for(turn, 60)
    assert got.types[-2:] == ["error", "thread_lifecycle"], got.types
    assert got.events[-2]["error"] == "AGENT_NOT_FOUND" and name in got.events[-2]["message"]
    assert got.events[-1]["phase"] == "errored"
    assert "tool_result" not in got.types  # the call never ran
    # The task takes its next message (with an agent that exists).
    after = await main.turn("hello", task_id=task_id)
    assert after.events[-1]["phase"] == "completed"
