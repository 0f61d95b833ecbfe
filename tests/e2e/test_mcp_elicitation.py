"""An MCP server's question during a tool call, answered by a person (issue #31 item 8).

The reference ``@modelcontextprotocol/server-everything`` lists
``trigger-elicitation-request`` only to a client that offers elicitation; its
call asks for a form (``name`` required, an ``integer`` in 1..100, ...). The
engine asks through HITL: a ``hitl_request`` of kind ``elicitation`` with the
schema, answered over HTTP at ``/hitl/respond`` (checked against the schema:
a wrong answer is refused with 422 and nothing is written), and the answer
goes back to the server, whose result reaches the model as any call's does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from holdfast.testing.timescale import scaled
from tests.conftest import engine_env
from tests.e2e.test_asset_directory import (  # noqa: F401 (fixtures)
    client,
    everything,
    everything_http,
    make_agent,
    mcp_engine,
    register,
    result_text,
    stdio_body,
    unique,
)
from tests.e2e.test_tools_engine import by_type, tool_script
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses
from tests.sse_client import Received, execute
from tests.waiting import until

pytestmark = pytest.mark.timeout(240)

_TOOL = "trigger-elicitation-request"


@pytest.fixture(scope="module")
def engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    with mcp_engine(
        engine_env(redis_url, database_url, f"{redis_prefix}elicit:"),
        everything,
        tmp_path_factory,
        "elicit",
        # The person's time to answer comes out of the call's.
        timeout_seconds=90,
    ) as e:
        yield e


async def _asking_agent(
    client: httpx.AsyncClient,  # noqa: F811
    base: str,
    key: str,
    body: dict[str, Any],
) -> tuple[str, str]:
    """A registered server (``body``) and an agent allowed to call its asking tool."""
    created = await register(client, base, key, body)
    assert created.status_code == 201, created.text
    # Offered elicitation at the probe, the server lists the tool that asks.
    assert _TOOL in {tool["name"] for tool in created.json()["tools"]}
    tool = f"{body['name']}__{_TOOL}"
    agent = await make_agent(client, base, key, [body["name"]], permissions={tool: "allow"})
    return agent, tool


async def _pending(
    client: httpx.AsyncClient,  # noqa: F811
    base: str,
    key: str,
    task_id: str,
) -> dict[str, Any]:
    """The task's elicitation request, once the server asked (the turn waits meanwhile)."""
    found: list[dict[str, Any]] = []

    async def asked() -> bool:
        got = await client.get(
            f"{base}/hitl/pending", params={"task_id": task_id}, headers={"X-Engine-Key": key}
        )
        found[:] = [p for p in got.json()["pending"] if p["kind"] == "elicitation"]
        return bool(found)

    await until(asked, "the server's question never reached /hitl/pending", within=scaled(60))
    return found[0]


async def _respond(
    client: httpx.AsyncClient,  # noqa: F811
    base: str,
    key: str,
    body: dict[str, Any],
) -> httpx.Response:
    return await client.post(f"{base}/hitl/respond", json=body, headers={"X-Engine-Key": key})


def _asked_and_resolved(got: Received, request_id: str, action: str) -> None:
    (request,) = by_type(got, "hitl_request")
    assert request["kind"] == "elicitation" and request["request_id"] == request_id
    assert request["requested_schema"]["required"] == ["name"]
    assert request["question"].startswith("Please provide inputs")
    (resolved,) = by_type(got, "hitl_resolved")
    assert resolved["answer"] == action
    # Asked during the call, answered before its result.
    order = [e["type"] for e in got.events]
    assert (
        order.index("tool_call")
        < order.index("hitl_request")
        < order.index("hitl_resolved")
        < order.index("tool_result")
    ), order


async def test_an_accepted_answer_reaches_the_server_and_a_wrong_one_is_refused(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("asking")
    agent, tool = await _asking_agent(client, base, key, stdio_body(name, everything))
    task_id = unique("asking-task")
    body = {"message": tool_script({"name": tool, "input": {}}), "agent": agent}
    turn = asyncio.create_task(execute(client, base, key, {**body, "task_id": task_id}))

    pending = await _pending(client, base, key, task_id)
    schema = pending["tool_call"]["requested_schema"]
    assert schema["properties"]["integer"]["maximum"] == 100
    request = {"task_id": task_id, "request_id": pending["request_id"]}

    # No name (required), an integer out of range, a boolean that is a string.
    wrong = await _respond(
        client,
        base,
        key,
        {**request, "answer": "accept", "content": {"integer": 500, "check": "yes"}},
    )
    assert wrong.status_code == 422, wrong.text
    error = wrong.json()
    assert error["error"] == "INVALID_REQUEST", error
    fields = {problem["field"] for problem in error["details"]["errors"]}
    assert {"integer", "check"} <= fields, error
    assert "'name' is a required property" in error["message"], error
    no_content = await _respond(client, base, key, {**request, "answer": "accept"})
    assert no_content.status_code == 422, no_content.text
    # Refused answers write nothing: the question is still open.
    assert (await _pending(client, base, key, task_id))["request_id"] == pending["request_id"]

    content = {"name": "Ada Lovelace", "check": True, "integer": 7}
    right = await _respond(client, base, key, {**request, "answer": "accept", "content": content})
    assert right.status_code == 200, right.text
    got = await asyncio.wait_for(turn, timeout=scaled(120))
    assert got.events[-1]["phase"] == "completed", got.events
    _asked_and_resolved(got, pending["request_id"], "accept")
    text = result_text(by_type(got, "tool_result")[0])
    assert "Name: Ada Lovelace" in text and "Favorite Integer: 7" in text, text
    again = await _respond(client, base, key, {**request, "answer": "decline"})
    assert again.status_code == 409, again.text


async def test_a_declined_question_over_streamable_http(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything_http: str,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("asking-http")
    server = {"name": name, "transport": "streamable-http", "url": everything_http}
    agent, tool = await _asking_agent(client, base, key, server)
    task_id = unique("asking-http-task")
    body = {"message": tool_script({"name": tool, "input": {}}), "agent": agent}
    turn = asyncio.create_task(execute(client, base, key, {**body, "task_id": task_id}))

    pending = await _pending(client, base, key, task_id)
    request = {"task_id": task_id, "request_id": pending["request_id"]}
    with_content = await _respond(
        client, base, key, {**request, "answer": "decline", "content": {"name": "x"}}
    )
    assert with_content.status_code == 422, with_content.text
    unknown = await _respond(client, base, key, {**request, "answer": "maybe"})
    assert unknown.status_code == 422, unknown.text
    assert unknown.json()["details"]["answers"] == ["accept", "decline", "cancel"]

    declined = await _respond(client, base, key, {**request, "answer": "Decline"})
    assert declined.status_code == 200, declined.text
    got = await asyncio.wait_for(turn, timeout=scaled(120))
    assert got.events[-1]["phase"] == "completed", got.events
    _asked_and_resolved(got, pending["request_id"], "decline")
    assert "User declined" in result_text(by_type(got, "tool_result")[0])


async def test_a_sampling_request_is_served_by_the_agents_model(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,  # noqa: F811
    client: httpx.AsyncClient,  # noqa: F811
) -> None:
    """``trigger-sampling-request`` (listed only to a client that offers sampling)
    asks the client's model; the engine's scripted model answers (it echoes)."""
    base, key = engine.url, api_keys["main"]
    name = unique("sampling")
    created = await register(client, base, key, stdio_body(name, everything))
    assert created.status_code == 201, created.text
    assert "trigger-sampling-request" in {tool["name"] for tool in created.json()["tools"]}
    tool = f"{name}__trigger-sampling-request"
    agent = await make_agent(client, base, key, [name], permissions={tool: "allow"})
    call = {"name": tool, "input": {"prompt": "name three rivers", "maxTokens": 50}}
    got = await execute(
        client,
        base,
        key,
        {"message": tool_script(call), "agent": agent, "task_id": unique("sampling-task")},
    )
    assert got.events[-1]["phase"] == "completed", got.events
    (result,) = by_type(got, "tool_result")
    assert "error" not in result, result
    sampled = json.loads(result_text(result).split("LLM sampling result:", 1)[1])
    assert sampled["model"].startswith("scripted:"), sampled
    assert sampled["content"] == {
        "type": "text",
        "text": "You said: Resource trigger-sampling-request context: name three rivers",
    }
    assert sampled["role"] == "assistant" and sampled["stopReason"] == "endTurn"
    # The sub-call's tokens are in the turn's usage: the scripted model counts
    # words, so its seven words beside the turn's own streamed answer.
    usage = by_type(got, "usage")[-1]
    streamed = len(got.text.split())
    assert usage["output_tokens"] >= streamed + len(sampled["content"]["text"].split()), usage
