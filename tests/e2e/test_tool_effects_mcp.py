"""Tool effects of an MCP server built with the official SDK (``MCPServer``, mcp 2.x):
the classes its annotations give (and its server entry overrides), shown by the
gateway, and the idempotency key its calls carry in ``_meta`` and, over HTTP, in
the ``Idempotency-Key`` header (#26)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from holdfast_shared.jobs import idempotency_key
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import ToolAnnotations

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.oauth_stand_in import _free_port, _Thread
from tests.processes import EngineProcesses, running_engine
from tests.sse_client import execute
from tests.taskids import TENANTS, engine_task_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

META = "io.holdfast/idempotency-key"


class KeyedServer:
    """An unauthenticated MCPServer whose tools carry each annotation and note the
    idempotency key each call arrived with (``_meta`` and header)."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.calls: list[dict[str, Any]] = []
        mcp = MCPServer("keyed")

        def noted(tool: str, ctx: Context) -> str:
            request = ctx.request_context.request
            headers = getattr(request, "headers", {})
            meta = ctx.request_context.meta or {}
            self.calls.append(
                {"tool": tool, "meta": meta.get(META), "header": headers.get("idempotency-key")}
            )
            return f"{tool} done"

        @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
        def look(ctx: Context) -> str:
            """Read something."""
            return noted("look", ctx)

        @mcp.tool(annotations=ToolAnnotations(idempotent_hint=True))
        def put(ctx: Context) -> str:
            """Set something to a value."""
            return noted("put", ctx)

        @mcp.tool()
        def pay(amount: int, ctx: Context) -> str:
            """Pay an amount."""
            return noted("pay", ctx)

        @mcp.tool(annotations=ToolAnnotations(destructive_hint=True))
        def wipe(ctx: Context) -> str:
            """Remove everything."""
            return noted("wipe", ctx)

        self._thread = _Thread(mcp.streamable_http_app(), self.port)

    def __enter__(self) -> KeyedServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.stop()


@pytest.fixture(scope="module")
def engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}effects-mcp:",
        HOLDFAST_WORKSPACE_ROOT=str(tmp_path_factory.mktemp("effects-mcp-workspaces")),
    )
    with running_engine(env, runners=1, directory=tmp_path_factory.mktemp("effects-mcp")) as procs:
        yield procs


async def test_annotations_give_the_classes_and_calls_carry_the_key(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    headers = {"X-Engine-Key": api_keys["main"]}
    name = f"keyed-{secrets.token_hex(3)}"
    with KeyedServer() as server:
        async with httpx.AsyncClient(timeout=60) as client:
            registered = await client.post(
                f"{engine.url}/assets/servers",
                json={
                    "name": name,
                    "transport": "streamable-http",
                    "url": server.url,
                    # The server entry's word over an annotation.
                    "effects": {"wipe": "idempotent"},
                },
                headers=headers,
            )
            assert registered.status_code == 201, registered.text
            shown = (
                await client.get(f"{engine.url}/assets/servers/{name}", headers=headers)
            ).json()
            classes = {tool["name"]: tool["effect"] for tool in shown["tools"]}
            assert classes == {
                "look": "read_only",
                "put": "idempotent",
                "pay": "effectful",
                "wipe": "idempotent",
            }
            agent = f"keyed-agent-{secrets.token_hex(3)}"
            created = await client.post(
                f"{engine.url}/agents",
                json={
                    "name": agent,
                    "description": "pays",
                    "system_prompt": "You pay.",
                    "servers": [name],
                    "permissions": {f"{name}__*": "allow"},
                    "effects": {f"{name}__look": "effectful"},
                },
                headers=headers,
            )
            assert created.status_code == 201, created.text
            described = (await client.get(f"{engine.url}/agents/{agent}", headers=headers)).json()
            # Each of its servers' tools' class: the agent's rule over the server's.
            assert {k: v for k, v in described["effects"].items() if k.startswith(name)} == {
                f"{name}__look": "effectful",
                f"{name}__put": "idempotent",
                f"{name}__pay": "effectful",
                f"{name}__wipe": "idempotent",
            }
            task_id = f"keyed-{secrets.token_hex(3)}"
            message = "/script " + json.dumps(
                {"tool_calls": [{"name": f"{name}__pay", "input": {"amount": 5}}]}
            )
            got = await execute(
                client,
                engine.url,
                api_keys["main"],
                {"message": message, "task_id": task_id, "agent": agent},
            )
    assert got.events[-1]["phase"] == "completed", got.events
    call = next(e for e in got.events if e["type"] == "tool_call")
    task = await engine_task_id(sessions, task_id)
    expected = idempotency_key(TENANTS["main"], task, call["turn_id"], call["tool_call_id"])
    assert server.calls == [{"tool": "pay", "meta": expected, "header": expected}]
