"""The Asset Directory: MCP servers registered per tenant, their tools called by the model.

Against servers nobody here wrote: the reference ``@modelcontextprotocol/server-everything``
from the npm registry, over stdio (inside the sandbox) and over streamable HTTP,
and a server built with the Python SDK's ``MCPServer`` behind a small OAuth
authorization server (``tests/oauth_stand_in.py``: authorization code + PKCE,
refresh tokens, short expiry).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from holdfast_shared.assets import Vault, VaultError, model_name, server_tools
from holdfast_tool_runner.connectors.outcomes import Redactor
from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.conftest import engine_env
from tests.e2e.test_tools_engine import answer_when_asked, by_type, tool_script
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.oauth_stand_in import ProtectedNotes
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute
from tests.taskids import engine_task_id
from tests.waiting import logged, until, until_logged

pytestmark = pytest.mark.timeout(180)

EVERYTHING = "@modelcontextprotocol/server-everything"


# -- the pieces, without an engine --------------------------------------------------------


def test_the_vault_seals_and_a_rotated_key_still_opens() -> None:
    old, new = Vault.generate_key(), Vault.generate_key()
    sealed = Vault(old).seal({"token": "s3cret-value"})
    assert "s3cret-value" not in sealed
    assert Vault(f"{new},{old}").open(sealed) == {"token": "s3cret-value"}
    with pytest.raises(VaultError, match="cannot be decrypted") as refused:
        Vault(new).open(sealed)
    assert "s3cret" not in str(refused.value)
    with pytest.raises(VaultError, match="not a Fernet key"):
        Vault("not-a-key")


def test_outputs_and_errors_are_redacted_of_secrets() -> None:
    redactor = Redactor(["tok-123456", 'quo"te-secret', "ab"])  # "ab": too short to be one
    output = {"env": {"T": "tok-123456"}, "text": 'say quo"te-secret', "n": 1, "ab": "ab"}
    assert redactor.value(output) == {
        "env": {"T": "[redacted]"},
        "text": "say [redacted]",
        "n": 1,
        "ab": "ab",
    }
    assert redactor.text("failed with tok-123456") == "failed with [redacted]"


def test_tool_names_the_model_sees() -> None:
    tools = server_tools(
        "docs",
        [
            {
                "name": "search",
                "description": "d",
                "inputSchema": {"$schema": "x", "type": "object"},
                "annotations": {"readOnlyHint": True},
            },
            {"name": "add page!", "inputSchema": {}},
            {"name": "add page?", "inputSchema": {}},  # the same name once made safe
        ],
    )
    assert [t.name for t in tools] == ["docs__search", "docs__add_page_"]
    assert tools[0].spec.input_schema == {"type": "object", "properties": {}}
    assert [t.default_permission() for t in tools] == ["allow", "ask"]
    assert len(model_name("s", "x" * 100)) == 64


def test_a_gateway_without_the_encryption_key_does_not_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOLDFAST_")}
    env.update(
        HOLDFAST_REDIS_URL="redis://127.0.0.1:1/0",
        HOLDFAST_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
        HOLDFAST_DATA_DIR=str(tmp_path),
    )
    run = subprocess.run(
        [sys.executable, "-m", "holdfast", "gateway"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "HOLDFAST_ASSET_ENCRYPTION_KEY is not set" in run.stderr


# -- servers nobody here wrote ---------------------------------------------------------


@pytest.fixture(scope="session")
def everything(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference server's entry point, installed from the npm registry."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("node and npm are needed for the reference MCP servers")
    folder = tmp_path_factory.mktemp("mcp-everything")
    try:
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--silent", EVERYTHING],
            cwd=folder,
            check=True,
            capture_output=True,
            timeout=300,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"cannot install {EVERYTHING} with npm: {exc}")
    entry = folder / "node_modules" / EVERYTHING / "dist" / "index.js"
    if not entry.exists():
        pytest.skip(f"{EVERYTHING} installed without dist/index.js")
    return entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NodeServer:
    """``server-everything`` over streamable HTTP, as its own process."""

    def __init__(self, entry: Path, log: Path) -> None:
        self.entry = entry
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = log
        self._log = log.open("ab")
        self.process = subprocess.Popen(
            ["node", str(entry), "streamableHttp"],
            env={**os.environ, "PORT": str(self.port)},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                break
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server-everything did not listen; see {log}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        self._log.close()


@pytest.fixture(scope="session")
def everything_http(everything: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = NodeServer(everything, tmp_path_factory.mktemp("mcp-http") / "server.log")
    yield server.url
    server.kill()


# -- the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    everything: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    # The operator's word over a server's annotations (see test_operator_rules...).
    rules = {"*": {"policed__echo": "deny", "policed__toggle-simulated-logging": "allow"}}
    with mcp_engine(
        engine_env(redis_url, database_url, f"{redis_prefix}assets:"),
        everything,
        tmp_path_factory,
        "asset",
        timeout_seconds=20,
        connect_seconds=20,
        HOLDFAST_TOOL_PERMISSIONS=json.dumps(rules),
    ) as e:
        yield e


@contextmanager
def mcp_engine(
    env: dict[str, str],
    everything: Path,
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    *,
    timeout_seconds: int,
    connect_seconds: int = 30,
    **more: str,
) -> Iterator[EngineProcesses]:
    """An engine (``env``, one tool-runner, workspaces of its own) whose stdio MCP
    servers may read the reference server's install (``everything``)."""
    env = {
        **env,
        "HOLDFAST_LOG_LEVEL": "INFO",
        "HOLDFAST_ASSET_STDIO_PATHS": json.dumps([str(everything.parents[3])]),
        "HOLDFAST_TOOL_TIMEOUT_SECONDS": str(timeout_seconds),
        "HOLDFAST_ASSET_CONNECT_TIMEOUT_SECONDS": str(connect_seconds),
        "HOLDFAST_WORKSPACE_ROOT": str(tmp_path_factory.mktemp(f"{name}-workspaces")),
        **more,
    }
    with running_engine(env, runners=1, directory=tmp_path_factory.mktemp(f"{name}-engine")) as e:
        yield e


def _headers(key: str) -> dict[str, str]:
    return {"X-Engine-Key": key}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=90) as c:
        yield c


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


async def register(
    client: httpx.AsyncClient, base: str, key: str, body: dict[str, Any]
) -> httpx.Response:
    return await client.post(f"{base}/assets/servers", json=body, headers=_headers(key))


async def make_agent(
    client: httpx.AsyncClient, base: str, key: str, servers: list[str], **extra: Any
) -> str:
    name = unique("mcp-agent")
    response = await client.post(
        f"{base}/agents",
        json={
            "name": name,
            "description": "uses MCP tools",
            "system_prompt": "You use the tools of your MCP servers.",
            "servers": servers,
            **extra,
        },
        headers=_headers(key),
    )
    assert response.status_code == 201, response.text
    return name


def stdio_body(name: str, entry: Path, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "transport": "stdio",
        "command": "node",
        "args": [str(entry), "stdio"],
        **extra,
    }


def result_text(result: dict[str, Any]) -> str:
    return " ".join(
        block.get("text", "") for block in (result.get("output") or {}).get("content", [])
    )


# -- registration ------------------------------------------------------------------------


async def test_register_a_streamable_http_server_and_list_its_tools(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything_http: str,
    client: httpx.AsyncClient,
) -> None:
    base, key, other = engine.url, api_keys["main"], api_keys["other"]
    name = unique("everything")
    created = await register(
        client, base, key, {"name": name, "transport": "streamable-http", "url": everything_http}
    )
    assert created.status_code == 201, created.text
    server = created.json()
    assert server["status"] == "ready" and server["auth"] == {"type": "none", "authorized": True}
    tools = {tool["name"]: tool for tool in server["tools"]}
    assert tools["echo"]["model_name"] == f"{name}__echo"
    assert tools["echo"]["inputSchema"]["properties"]["message"]["type"] == "string"
    assert tools["echo"]["annotations"]["readOnlyHint"] is True
    assert server["tool_count"] == len(tools) > 5

    listed = (await client.get(f"{base}/assets/servers", headers=_headers(key))).json()
    assert name in [s["name"] for s in listed["servers"]]
    got = await client.get(f"{base}/assets/servers/{name}/tools", headers=_headers(key))
    assert got.status_code == 200 and got.json()["tools"] == server["tools"]

    again = await register(
        client, base, key, {"name": name, "transport": "streamable-http", "url": everything_http}
    )
    assert again.status_code == 409 and again.json()["error"] == "ASSET_EXISTS"

    # Another tenant sees nothing of it, and cannot delete it.
    for method, path in (
        ("GET", f"/assets/servers/{name}/tools"),
        ("GET", f"/assets/servers/{name}"),
        ("DELETE", f"/assets/servers/{name}"),
        ("GET", f"/assets/servers/{name}/connect"),
    ):
        response = await client.request(method, base + path, headers=_headers(other))
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"] == "ASSET_NOT_FOUND"
    others = (await client.get(f"{base}/assets/servers", headers=_headers(other))).json()
    assert name not in [s["name"] for s in others["servers"]]

    deleted = await client.delete(f"{base}/assets/servers/{name}", headers=_headers(key))
    assert deleted.status_code == 204
    gone = await client.get(f"{base}/assets/servers/{name}/tools", headers=_headers(key))
    assert gone.status_code == 404 and gone.json()["error"] == "ASSET_NOT_FOUND"


async def test_registration_refusals_name_the_fields(
    engine: EngineProcesses, api_keys: dict[str, str], client: httpx.AsyncClient
) -> None:
    base, key = engine.url, api_keys["main"]

    async def refused(body: dict[str, Any]) -> list[str]:
        """The fields a 422 names (each ``loc`` joined, the body's transport tag included)."""
        response = await register(client, base, key, body)
        assert response.status_code == 422, response.text
        assert response.json()["error"] == "INVALID_REQUEST"
        return [".".join(e["loc"]) for e in response.json()["details"]["errors"]]

    assert "body.streamable-http.url" in await refused(
        {"name": "x1", "transport": "streamable-http"}
    )
    assert "body.stdio.command" in await refused({"name": "x2", "transport": "stdio"})
    # What one transport takes, the other refuses.
    assert "body.stdio.url" in await refused(
        {"name": "x3", "transport": "stdio", "command": "node", "url": "http://127.0.0.1:1/"}
    )
    assert "body.streamable-http.command" in await refused(
        {"name": "x3", "transport": "streamable-http", "url": "http://127.0.0.1:1/", "command": "x"}
    )
    assert "body.stdio.auth" in await refused(
        {"name": "x3", "transport": "stdio", "command": "node", "auth": {"type": "none"}}
    )
    assert "body.stdio.name" in await refused(
        {"name": "two__underscores", "transport": "stdio", "command": "node"}
    )
    assert "body.streamable-http.url" in await refused(
        {"name": "x4", "transport": "streamable-http", "url": "ftp://example.com/"}
    )
    assert "body" in await refused({"name": "x4", "transport": "carrier-pigeon"})
    fields = await refused(
        {"name": "x5", "transport": "stdio", "command": "node", "env": {"1BAD": "x"}}
    )
    assert any(field.startswith("body.stdio.env") for field in fields)
    # Nothing was stored by any of them.
    listed = (await client.get(f"{base}/assets/servers", headers=_headers(key))).json()
    assert not {"x1", "x2", "x3", "x4", "x5"} & {s["name"] for s in listed["servers"]}


async def test_an_unreachable_server_is_refused_and_not_kept(
    engine: EngineProcesses, api_keys: dict[str, str], client: httpx.AsyncClient, everything: Path
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("nowhere")
    url = f"http://127.0.0.1:{_free_port()}/mcp"
    response = await register(
        client, base, key, {"name": name, "transport": "streamable-http", "url": url}
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "ASSET_UNAVAILABLE"
    assert response.json()["details"]["errors"][0]["loc"] == ["body", "url"]
    # A URL of the right form that no HTTP client can use.
    response = await register(
        client, base, key, {"name": name, "transport": "streamable-http", "url": "http://[::1"}
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "ASSET_UNAVAILABLE"
    # A command that is no MCP server (it exits at once, in the sandbox).
    response = await register(
        client, base, key, {"name": name, "transport": "stdio", "command": "/bin/true"}
    )
    assert response.status_code == 422, response.text
    assert response.json()["details"]["errors"][0]["loc"] == ["body", "command"]
    listed = (await client.get(f"{base}/assets/servers", headers=_headers(key))).json()
    assert name not in [s["name"] for s in listed["servers"]]


async def test_agents_may_name_only_the_tenants_servers(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything_http: str,
    client: httpx.AsyncClient,
) -> None:
    base, key, other = engine.url, api_keys["main"], api_keys["other"]
    name = unique("mine")
    created = await register(
        client, base, key, {"name": name, "transport": "streamable-http", "url": everything_http}
    )
    assert created.status_code == 201, created.text
    await make_agent(client, base, key, [name])  # the tenant's own: accepted
    refused = await client.post(
        f"{base}/agents",
        json={"name": unique("thief"), "description": "d", "system_prompt": "p", "servers": [name]},
        headers=_headers(other),
    )
    assert refused.status_code == 422
    error = refused.json()["details"]["errors"][0]
    assert error["loc"] == ["body", "servers", "0"] and error["type"] == "unknown_server"


# -- tools in the loop -------------------------------------------------------------------


async def test_the_model_calls_a_streamable_http_servers_tool(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything_http: str,
    client: httpx.AsyncClient,
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("web")
    created = await register(
        client, base, key, {"name": name, "transport": "streamable-http", "url": everything_http}
    )
    assert created.status_code == 201, created.text
    agent = await make_agent(client, base, key, [name])
    offered = await execute(
        client,
        base,
        key,
        {"message": '/script {"echo_request": true}', "agent": agent, "task_id": unique("offer")},
    )
    assert f"{name}__echo" in json.loads(offered.text)["tools"]

    message = tool_script({"name": f"{name}__echo", "input": {"message": "hi"}})
    got = await execute(
        client, base, key, {"message": message, "agent": agent, "task_id": unique("call")}
    )
    assert got.events[-1]["phase"] == "completed", got.events
    assert "hitl_request" not in got.types  # echo is read-only: allowed
    result = by_type(got, "tool_result")[0]
    assert "error" not in result, result
    assert result_text(result) == "Echo: hi"
    assert "Echo: hi" in got.text  # the model saw it


async def test_the_model_calls_a_stdio_server_in_the_sandbox_and_reuses_its_session(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,
    client: httpx.AsyncClient,
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("local")
    created = await register(client, base, key, stdio_body(name, everything))
    assert created.status_code == 201, created.text
    assert "echo" in {tool["name"] for tool in created.json()["tools"]}
    agent = await make_agent(client, base, key, [name])
    message = tool_script(
        {"name": f"{name}__echo", "input": {"message": "one"}},
        {"name": f"{name}__get-env", "input": {}},
    )
    got = await execute(
        client, base, key, {"message": message, "agent": agent, "task_id": unique("stdio")}
    )
    assert got.events[-1]["phase"] == "completed", got.events
    results = by_type(got, "tool_result")
    assert result_text(results[0]) == "Echo: one"
    env = json.loads(result_text(results[1]))
    # The sandbox's environment, not the runner's: no HOLDFAST_ variable reaches it.
    assert env["HOME"] == "/workspace"
    assert not [k for k in env if k.startswith("HOLDFAST_")]


async def test_a_write_tool_asks_first_and_a_park_stops_its_server(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,
    client: httpx.AsyncClient,
) -> None:
    """toggle-simulated-logging is not annotated read-only: each call asks. It
    keeps state in the server, so its answers show which session served it: a
    parked task's stdio servers are stopped (security issue #23), so each call
    after a question finds a fresh one."""
    base, key = engine.url, api_keys["main"]
    name = unique("toggler")
    assert (await register(client, base, key, stdio_body(name, everything))).status_code == 201
    agent = await make_agent(client, base, key, [name])
    task_id = unique("ask")
    toggle = {"name": f"{name}__toggle-simulated-logging", "input": {}}
    turn = asyncio.create_task(
        execute(
            client,
            base,
            key,
            {"message": tool_script(toggle, toggle), "agent": agent, "task_id": task_id},
        )
    )
    first = await answer_when_asked(client, base, key, task_id, {"answer": "yes"})
    assert first["tool_call"]["tool"] == f"{name}__toggle-simulated-logging"
    await answer_when_asked(client, base, key, task_id, {"answer": "yes"})
    got = await turn
    assert got.events[-1]["phase"] == "completed", got.events
    assert len(by_type(got, "hitl_request")) == 2
    started, restarted = (result_text(r) for r in by_type(got, "tool_result"))
    # The park between the two calls stopped the first call's server.
    assert started.startswith("Started") and restarted.startswith("Started")

    # The next turn asks again (a park again): its server starts afresh too.
    turn = asyncio.create_task(
        execute(
            client, base, key, {"message": tool_script(toggle), "agent": agent, "task_id": task_id}
        )
    )
    await answer_when_asked(client, base, key, task_id, {"answer": "yes"})
    again = await turn
    assert result_text(by_type(again, "tool_result")[0]).startswith("Started")

    # A refusal reaches the model; the server never sees the call.
    turn = asyncio.create_task(
        execute(
            client, base, key, {"message": tool_script(toggle), "agent": agent, "task_id": task_id}
        )
    )
    await answer_when_asked(client, base, key, task_id, {"answer": "no"})
    refused = await turn
    assert "denied" in by_type(refused, "tool_result")[0]["error"]
    assert refused.events[-1]["phase"] == "completed"


async def test_operator_rules_override_a_servers_annotations(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything_http: str,
    client: httpx.AsyncClient,
) -> None:
    """HOLDFAST_TOOL_PERMISSIONS (set for this engine): policed__echo deny,
    policed__toggle-simulated-logging allow."""
    base, key = engine.url, api_keys["main"]
    body = {"name": "policed", "transport": "streamable-http", "url": everything_http}
    created = await register(client, base, key, body)
    assert created.status_code in (201, 409), created.text
    agent = await make_agent(client, base, key, ["policed"])
    message = tool_script(
        {"name": "policed__echo", "input": {"message": "x"}},
        {"name": "policed__toggle-simulated-logging", "input": {}},
    )
    got = await execute(
        client, base, key, {"message": message, "agent": agent, "task_id": unique("policy")}
    )
    assert "hitl_request" not in got.types
    denied, allowed = by_type(got, "tool_result")
    assert "permission denied" in denied["error"]
    assert "error" not in allowed and result_text(allowed).startswith("Started")


async def test_an_agents_own_rules_for_its_servers_tools(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything_http: str,
    client: httpx.AsyncClient,
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("ruled")
    body = {"name": name, "transport": "streamable-http", "url": everything_http}
    assert (await register(client, base, key, body)).status_code == 201
    rules = {f"{name}__*": "allow", f"{name}__echo": "deny"}
    agent = await make_agent(client, base, key, [name], permissions=rules)
    stored = (await client.get(f"{base}/agents/{agent}", headers=_headers(key))).json()
    assert stored["permissions"][f"{name}__echo"] == "deny"
    message = tool_script(
        {"name": f"{name}__echo", "input": {"message": "x"}},
        {"name": f"{name}__toggle-simulated-logging", "input": {}},  # a write: allowed by *
    )
    got = await execute(
        client, base, key, {"message": message, "agent": agent, "task_id": unique("rules")}
    )
    assert "hitl_request" not in got.types
    denied, allowed = by_type(got, "tool_result")
    assert "permission denied" in denied["error"]
    assert result_text(allowed).startswith("Started")

    # A rule for a server the agent does not name is refused, naming it.
    refused = await client.post(
        f"{base}/agents",
        json={
            "name": unique("overreach"),
            "description": "d",
            "system_prompt": "p",
            "permissions": {"elsewhere__echo": "allow"},
        },
        headers=_headers(key),
    )
    assert refused.status_code == 422, refused.text
    error = refused.json()["details"]["errors"][0]
    assert error["loc"] == ["body", "permissions", "elsewhere__echo"]


async def test_a_tool_the_agent_has_no_server_for_is_unknown(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything_http: str,
    client: httpx.AsyncClient,
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("unlisted")
    body = {"name": name, "transport": "streamable-http", "url": everything_http}
    assert (await register(client, base, key, body)).status_code == 201
    # The general agent names no servers: the tool is not offered, and a call is refused.
    got = await execute(
        client,
        base,
        key,
        {
            "message": tool_script({"name": f"{name}__echo", "input": {"message": "x"}}),
            "task_id": unique("unknown"),
        },
    )
    assert "unknown tool" in by_type(got, "tool_result")[0]["error"]
    assert got.events[-1]["phase"] == "completed"


# -- failures ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_an_http_server_killed_mid_call_is_settled_and_the_turn_goes_on(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,
    client: httpx.AsyncClient,
    tmp_path: Path,
) -> None:
    base, key = engine.url, api_keys["main"]
    server = NodeServer(everything, tmp_path / "doomed.log")
    try:
        name = unique("doomed")
        body = {"name": name, "transport": "streamable-http", "url": server.url}
        assert (await register(client, base, key, body)).status_code == 201
        long = {
            "name": f"{name}__trigger-long-running-operation",
            "input": {"duration": 8, "steps": 8},
        }
        # The server marks it read-only (it would be run again): here it has effects.
        agent = await make_agent(client, base, key, [name], effects={long["name"]: "effectful"})
        after = {"name": f"{name}__echo", "input": {"message": "still there?"}}
        task_id = unique("kill")
        turn = asyncio.create_task(
            execute(
                client,
                base,
                key,
                {"message": tool_script(long, after), "agent": agent, "task_id": task_id},
            )
        )
        await until_logged(client, base, key, task_id, logged("tool_call"), "no tool_call")
        await until(lambda: _call_received(server.log), "the call never reached the server")
        server.kill()
        await _settle_as_failed(client, base, key, task_id)
        got = await turn
    finally:
        server.kill()
    assert got.events[-1]["phase"] == "completed", got.events
    (unknown,) = by_type(got, "tool_outcome_unknown")
    assert name in unknown["reason"], unknown
    cut, later = by_type(got, "tool_result")
    assert cut["error"] and name in cut["error"], cut
    assert later["error"], later  # the server is gone for good: an error, not a hang


@pytest.mark.slow
async def test_a_stdio_server_killed_mid_call_is_settled_and_the_turn_goes_on(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,
    client: httpx.AsyncClient,
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("fragile")
    assert (await register(client, base, key, stdio_body(name, everything))).status_code == 201
    long = {"name": f"{name}__trigger-long-running-operation", "input": {"duration": 8, "steps": 8}}
    # A quick call in a first turn, the long one in the next: a turn's end keeps
    # the task's stdio server, up and idle, and what it reads next is the long call.
    echo = {"name": f"{name}__echo", "input": {"message": "connected"}}
    agent = await make_agent(
        client,
        base,
        key,
        [name],
        # The server marks it read-only (it would be run again): here it has effects.
        effects={long["name"]: "effectful"},
    )
    task_id = unique("stdio-kill")
    before = {process.pid for process in _stdio_servers(everything)}
    first = await execute(
        client, base, key, {"message": tool_script(echo), "agent": agent, "task_id": task_id}
    )
    assert result_text(by_type(first, "tool_result")[0]) == "Echo: connected"
    # (A process the registration's probe started may still be on its way out.)
    idle = {p.pid: _read_chars(p) for p in _stdio_servers(everything) if p.pid not in before}
    victims = [p for p in _stdio_servers(everything) if idle.get(p.pid, -1) >= 0]
    assert victims, "the stdio server never started, or the turn's end stopped it"
    turn = asyncio.create_task(
        execute(
            client, base, key, {"message": tool_script(long), "agent": agent, "task_id": task_id}
        )
    )

    async def called() -> bool:
        return any(_read_chars(v) >= idle[v.pid] + _CALL_BYTES for v in victims)

    await until(called, "the long call never reached the server")
    for victim in victims:
        victim.kill()
    await _settle_as_failed(client, base, key, task_id)
    got = await turn
    assert got.events[-1]["phase"] == "completed", got.events
    (result,) = by_type(got, "tool_result")
    (unknown,) = by_type(got, "tool_outcome_unknown")
    assert name in unknown["reason"], unknown
    assert "cannot connect" not in unknown["reason"], "killed before its session was up"
    assert result["error"] and name in result["error"], result


@pytest.mark.slow
async def test_a_call_past_its_timeout_is_settled_and_the_next_one_gets_a_new_session(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything_http: str,
    client: httpx.AsyncClient,
) -> None:
    """HOLDFAST_TOOL_TIMEOUT_SECONDS is 20 on this engine."""
    base, key = engine.url, api_keys["main"]
    name = unique("slow")
    body = {"name": name, "transport": "streamable-http", "url": everything_http}
    assert (await register(client, base, key, body)).status_code == 201
    long = {
        "name": f"{name}__trigger-long-running-operation",
        "input": {"duration": 60, "steps": 2},
    }
    # The server marks it read-only (it would be run again): here it has effects.
    agent = await make_agent(client, base, key, [name], effects={long["name"]: "effectful"})
    after = {"name": f"{name}__echo", "input": {"message": "after"}}
    started = time.monotonic()
    task_id = unique("timeout")
    turn = asyncio.create_task(
        execute(
            client,
            base,
            key,
            {"message": tool_script(long, after), "agent": agent, "task_id": task_id},
        )
    )
    await _settle_as_failed(client, base, key, task_id, within=90)
    got = await turn
    # 20 s of timeout, the question and its answer: well under the call's own 60 s.
    assert time.monotonic() - started < 55
    assert got.events[-1]["phase"] == "completed", got.events
    (unknown,) = by_type(got, "tool_outcome_unknown")
    assert "did not answer within 20 s" in unknown["reason"], unknown
    late, later = by_type(got, "tool_result")
    assert "did not take effect" in late["error"], late
    assert result_text(later) == "Echo: after"


async def _settle_as_failed(
    client: httpx.AsyncClient, base: str, key: str, task_id: str, within: float = 30.0
) -> None:
    """The call's outcome is unknown (sent, never answered) and the agent classes the
    tool effectful: a person is asked (#26); answer ``failed``."""
    await until_logged(
        client,
        base,
        key,
        task_id,
        lambda events: any(e.get("kind") == "outcome_unknown" for e in events),
        "no outcome_unknown request",
        within=within,
    )
    request = await answer_when_asked(client, base, key, task_id, {"answer": "failed"})
    assert request["kind"] == "outcome_unknown", request


# Less than the JSON-RPC tools/call of the long operation (about 150 bytes).
_CALL_BYTES = 100


def _read_chars(process: psutil.Process) -> int:
    """Bytes the process has read so far (files and pipes); -1 once it is gone."""
    try:
        return int(process.io_counters().read_chars)
    except psutil.NoSuchProcess:
        return -1


async def _call_received(log: Path) -> bool:
    """server-everything logs each HTTP request: the call's session (the one after the
    registration's probe) is open and has had a request after its handshake's
    ``notifications/initialized``: the call."""
    text = await asyncio.to_thread(log.read_text, errors="replace")
    sessions = text.split("Session initialized with ID:")
    return (
        len(sessions) >= 3
        and "session termination" not in sessions[-1]
        and sessions[-1].count("Received MCP POST request") >= 2
    )


def _stdio_servers(entry: Path) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "node" in (cmdline[:1] or [""])[0] and str(entry) in cmdline and "stdio" in cmdline:
            found.append(process)
    return found


# -- credentials ---------------------------------------------------------------------------


async def _everything_stored(sessions: async_sessionmaker[AsyncSession]) -> str:
    """Every row of every table, as text."""
    chunks: list[str] = []
    async with sessions() as session:
        tables = await session.scalars(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        )
        for table in list(tables):
            rows = await session.scalars(text(f'SELECT t::text FROM "{table}" t'))
            chunks.extend(rows)
    return "\n".join(chunks)


async def _everything_in_redis(redis: Redis, prefix: str) -> str:
    chunks: list[str] = []
    async for key in redis.scan_iter(match=f"{prefix}*", count=1000):
        kind = await redis.type(key)
        if kind == "string":
            chunks.append(str(await redis.get(key)))
        elif kind == "hash":
            chunks.append(json.dumps(await redis.hgetall(key)))
        elif kind == "stream":
            chunks.append(json.dumps(await redis.xrange(key)))
        elif kind == "list":
            chunks.append(json.dumps(await redis.lrange(key, 0, -1)))
        elif kind == "zset":
            chunks.append(json.dumps(await redis.zrange(key, 0, -1)))
        elif kind == "set":
            chunks.append(json.dumps(sorted(await redis.smembers(key))))
    return "\n".join(chunks)


async def test_credentials_never_appear_in_events_logs_snapshots_or_errors(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    everything: Path,
    everything_http: str,
    client: httpx.AsyncClient,
    sessions: async_sessionmaker[AsyncSession],
    redis: Redis,
) -> None:
    base, key = engine.url, api_keys["main"]
    token = f"bearer-{secrets.token_hex(16)}"
    env_secret = f"envsecret-{secrets.token_hex(16)}"
    web, local = unique("bearer"), unique("envy")
    created = await register(
        client,
        base,
        key,
        {
            "name": web,
            "transport": "streamable-http",
            "url": everything_http,
            "auth": {"type": "bearer", "token": token},
        },
    )
    assert created.status_code == 201, created.text
    assert created.json()["auth"] == {"type": "bearer", "authorized": True}
    created = await register(
        client, base, key, stdio_body(local, everything, env={"API_TOKEN": env_secret})
    )
    assert created.status_code == 201, created.text
    assert created.json()["env"] == ["API_TOKEN"]
    agent = await make_agent(client, base, key, [web, local])
    task_id = unique("leak")
    message = tool_script(
        {"name": f"{web}__echo", "input": {"message": "hello"}},
        {"name": f"{local}__get-env", "input": {}},  # prints its environment, secret and all
        {"name": f"{web}__get-sum", "input": {"a": "not a number"}},  # an error
    )
    got = await execute(client, base, key, {"message": message, "agent": agent, "task_id": task_id})
    assert got.events[-1]["phase"] == "completed", got.events
    echoed, env, failed = by_type(got, "tool_result")
    assert result_text(echoed) == "Echo: hello"
    assert json.loads(result_text(env))["API_TOKEN"] == "[redacted]"
    assert failed.get("error")

    # Everything a client can read...
    seen = [got.events, (await client.get(f"{base}/assets/servers", headers=_headers(key))).json()]
    for name in (web, local):
        seen.append(
            (await client.get(f"{base}/assets/servers/{name}", headers=_headers(key))).json()
        )
    replayed = await client.get(
        f"{base}/execute/replay", params={"task_id": task_id, "after": 0}, headers=_headers(key)
    )
    seen.append(replayed.text)
    engine_id = await engine_task_id(sessions, task_id)

    async def archived() -> bool:  # the events the search below must find
        async with sessions() as session:
            last = await session.scalar(
                text("SELECT max(seq) FROM events WHERE task_id = :t"), {"t": engine_id}
            )
        return bool(last is not None and last >= got.events[-1]["seq"])

    await until(archived, "the turn's events never reached PostgreSQL")
    # ...everything stored (events, snapshots, messages, tool results, the
    # servers' own rows: sealed), everything in Redis, every log line.
    haystacks = {
        "responses": json.dumps(seen),
        "postgres": await _everything_stored(sessions),
        "redis": await _everything_in_redis(redis, engine.prefix),
        "logs": "\n".join(p.read_text(errors="replace") for p in engine.log_dir.glob("*.log")),
    }
    assert "Echo: hello" in haystacks["postgres"]  # the search does look at the events
    for where, haystack in haystacks.items():
        for secret in (token, env_secret):
            assert secret not in haystack, f"a credential in {where}"


# -- OAuth -----------------------------------------------------------------------------------


@pytest.fixture
def protected() -> Iterator[ProtectedNotes]:
    """A Python SDK MCPServer behind its own authorization server (3 s tokens)."""
    notes = ProtectedNotes(access_seconds=3).start()
    yield notes
    notes.stop()


async def authorize(
    client: httpx.AsyncClient, base: str, key: str, name: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Connect ``name`` as a user would: open the URL, come back to the callback."""
    connect = await client.get(f"{base}/assets/servers/{name}/connect", headers=_headers(key))
    assert connect.status_code == 200, connect.text
    # The authorization server approves and sends the browser back to the engine.
    approved = await client.get(connect.json()["authorization_url"])
    assert approved.status_code == 302, approved.text
    callback = await client.get(approved.headers["location"])
    assert callback.status_code == 200, callback.text
    return connect.json(), callback.json()


@pytest.mark.slow
async def test_oauth_connect_callback_and_a_token_refreshed_mid_task(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    protected: ProtectedNotes,
) -> None:
    base, key = engine.url, api_keys["main"]
    authority = protected.authorization
    name = unique("notes")
    created = await register(
        client,
        base,
        key,
        {
            "name": name,
            "transport": "streamable-http",
            "url": protected.url,
            "auth": {"type": "oauth2"},
        },
    )
    assert created.status_code == 201, created.text
    server = created.json()
    assert server["status"] == "needs_authorization" and server["tools"] == []
    assert server["auth"] == {"type": "oauth2", "authorized": False}

    connect, connected = await authorize(client, base, key, name)
    url = httpx.URL(connect["authorization_url"])
    assert url.host == "127.0.0.1" and url.port == authority.port and url.path == "/authorize"
    params = url.params
    assert params["code_challenge_method"] == "S256" and params["state"]
    assert params["resource"] == protected.url
    assert params["redirect_uri"] == connect["redirect_uri"] == f"{base}/assets/oauth/callback"
    assert params["client_id"] in authority.clients  # registered dynamically
    assert connected["status"] == "ready" and connected["error"] is None
    assert {t["name"] for t in connected["tools"]} == {"count_notes", "pause", "add_note"}
    assert authority.grants["authorization_code"] == 1 and not authority.refused
    # The state is spent: the callback cannot be replayed.
    replayed = await client.get(
        f"{base}/assets/oauth/callback", params={"code": "x", "state": params["state"]}
    )
    assert replayed.status_code == 404
    assert replayed.json()["error"] == "ASSET_NOT_FOUND"

    agent = await make_agent(client, base, key, [name])
    task_id = unique("oauth")
    # The access token lives 3 s: the second call of the turn needs a new one.
    message = tool_script(
        {"name": f"{name}__count_notes", "input": {}},
        {"name": f"{name}__pause", "input": {"seconds": 4}},
        {"name": f"{name}__count_notes", "input": {}},
    )
    got = await execute(client, base, key, {"message": message, "agent": agent, "task_id": task_id})
    assert got.events[-1]["phase"] == "completed", got.events
    results = by_type(got, "tool_result")
    assert [r.get("error") for r in results] == [None, None, None], results
    assert result_text(results[2]) == "0 note(s)"
    assert authority.grants["refresh_token"] >= 1

    # A token revoked before its time: the 401 is answered with one refresh.
    before = authority.grants["refresh_token"]
    authority.revoke_access()
    got = await execute(
        client,
        base,
        key,
        {
            "message": tool_script({"name": f"{name}__count_notes", "input": {}}),
            "agent": agent,
            "task_id": task_id,
        },
    )
    assert "error" not in by_type(got, "tool_result")[0], got.events
    assert authority.grants["refresh_token"] == before + 1
    # (Rotation: that worked only because every refreshed token was stored.)

    # Nothing left to refresh with: an error saying to connect again; the turn goes on.
    authority.revoke_everything()
    got = await execute(
        client,
        base,
        key,
        {
            "message": tool_script({"name": f"{name}__count_notes", "input": {}}),
            "agent": agent,
            "task_id": task_id,
        },
    )
    error = by_type(got, "tool_result")[0]["error"]
    assert "connect" in error, error
    assert got.events[-1]["phase"] == "completed"
    # The server says it needs connecting again (and its tools leave the agent's list).
    server = await client.get(f"{base}/assets/servers/{name}", headers=_headers(key))
    # (The call's error says which way it failed: a refused refresh, or no answer.)
    assert server.json()["status"] == "needs_authorization", (error, server.json())

    # No token the authorization server issued is anywhere it should not be.
    logs = "\n".join(p.read_text(errors="replace") for p in engine.log_dir.glob("*.log"))
    replayed_text = (
        await client.get(
            f"{base}/execute/replay",
            params={"task_id": task_id, "after": 0},
            headers=_headers(key),
        )
    ).text
    for token in authority.issued:
        assert token not in logs and token not in replayed_text


async def test_a_refused_authorization_and_a_non_oauth_server(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
    protected: ProtectedNotes,
    everything_http: str,
) -> None:
    base, key = engine.url, api_keys["main"]
    name = unique("notes")
    body = {
        "name": name,
        "transport": "streamable-http",
        "url": protected.url,
        "auth": {"type": "oauth2"},
    }
    assert (await register(client, base, key, body)).status_code == 201
    connect = await client.get(f"{base}/assets/servers/{name}/connect", headers=_headers(key))
    state = httpx.URL(connect.json()["authorization_url"]).params["state"]
    denied = await client.get(
        f"{base}/assets/oauth/callback", params={"error": "access_denied", "state": state}
    )
    assert denied.status_code == 400 and "access_denied" in denied.json()["message"]
    stored = (await client.get(f"{base}/assets/servers/{name}", headers=_headers(key))).json()
    assert stored["status"] == "needs_authorization"
    # A call before any authorization: an error for the model, not a failed turn.
    agent = await make_agent(client, base, key, [name])
    got = await execute(
        client,
        base,
        key,
        {
            "message": tool_script({"name": f"{name}__count_notes", "input": {}}),
            "agent": agent,
            "task_id": unique("unauthorized"),
        },
    )
    assert got.events[-1]["phase"] == "completed"
    assert "unknown tool" in by_type(got, "tool_result")[0]["error"]  # it offers no tools yet

    plain = unique("plain")
    body = {"name": plain, "transport": "streamable-http", "url": everything_http}
    assert (await register(client, base, key, body)).status_code == 201
    response = await client.get(f"{base}/assets/servers/{plain}/connect", headers=_headers(key))
    assert response.status_code == 409 and response.json()["error"] == "ASSET_NOT_OAUTH2"
