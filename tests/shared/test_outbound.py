"""The outbound policy (issue #23): where the engine may connect for a tenant.

The policy's pieces are tested with the world passed in (a resolver that answers
what the test says, a network backend that records what it dials); the engine's
use of it against real listeners: a gateway and a tool-runner started with an
allow-list that holds only 127.0.0.2, so the servers the tests want reachable
listen there, and a listener on 127.0.0.1 — the "internal service" — counts
every connection it gets (none may arrive).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpcore2
import httpx
import httpx2
import pytest
from holdfast_gateway.oauthflow import AuthorizationFailed, begin
from holdfast_shared.assets.oauth import OAuthRecord
from holdfast_shared.outbound import DestinationNotAllowed, OutboundPolicy, refusal
from holdfast_tool_runner.connectors.transports import http_transport

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, running_engine

pytestmark = pytest.mark.timeout(180)

ALLOWED_HOST = "127.0.0.2"
SECRET = "INTERNAL-SECRET-" + secrets.token_hex(8)


# -- real listeners ---------------------------------------------------------------------

Route = Callable[["Listener", str, str, dict[str, str], bytes], tuple[int, dict[str, str], bytes]]


@dataclass
class Listener:
    """A tiny HTTP/1.1 server on ``host`` that counts connections and answers by ``route``."""

    host: str
    route: Route | None = None
    connections: int = 0
    requests: list[tuple[str, str]] = field(default_factory=list)
    port: int = 0
    _server: asyncio.Server | None = None

    @property
    def origin(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def __aenter__(self) -> Listener:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (h.partition(":") for h in lines if h)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append((method, path))
                if self.route is None:
                    status, extra, content = 404, {}, b"nothing here"
                else:
                    status, extra, content = self.route(self, method, path, headers, body)
                out = [f"HTTP/1.1 {status} X", f"Content-Length: {len(content)}"]
                out += [f"{k}: {v}" for k, v in extra.items()]
                writer.write(("\r\n".join(out) + "\r\n\r\n").encode() + content)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()


def _json(status: int, value: Any, **headers: str) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json", **headers}, json.dumps(value).encode()


def oauth_server(registration_endpoint: Callable[[Listener], str]) -> Route:
    """An MCP server that wants OAuth, and its authorization server, on one origin;
    its metadata names ``registration_endpoint(listener)``; registration answers
    403 with an internal-looking body."""

    def route(
        me: Listener, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        origin = me.origin
        if path == "/mcp":
            challenge = f'Bearer resource_metadata="{origin}/.well-known/oauth-protected-resource"'
            return _json(401, {"error": "invalid_token"}, **{"WWW-Authenticate": challenge})
        if path.startswith("/.well-known/oauth-protected-resource"):
            return _json(200, {"resource": f"{origin}/mcp", "authorization_servers": [origin]})
        if path.startswith("/.well-known/oauth-authorization-server"):
            return _json(
                200,
                {
                    "issuer": origin,
                    "authorization_endpoint": f"{origin}/authorize",
                    "token_endpoint": f"{origin}/token",
                    "registration_endpoint": registration_endpoint(me),
                    "response_types_supported": ["code"],
                    "code_challenge_methods_supported": ["S256"],
                },
            )
        if path == "/register":
            return 403, {"Content-Type": "text/plain"}, f"admin panel: {SECRET}".encode()
        return 404, {}, b"not found"

    return route


# -- the policy, with the world passed in -----------------------------------------------


class Resolver:
    """Answers from a table; each call takes the next answer of the host's list."""

    def __init__(self, table: dict[str, list[list[str]]]) -> None:
        self.table = table
        self.calls: list[str] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.calls.append(host)
        answers = self.table.get(host)
        if not answers:
            raise OSError(f"no such host {host}")
        return answers.pop(0) if len(answers) > 1 else answers[0]


LOOPBACK_RESOLVER = {"localhost": [["127.0.0.1", "::1"]]}

REFUSED = [
    "localhost",
    "LocalHost.",
    "[::1]",
    "0x7f000001",
    "2130706433",
    "0177.0.0.1",
    "127.1",
    "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]",
    "[::127.0.0.1]",
    "[2002:7f00:1::]",
    "[64:ff9b::a9fe:a9fe]",
    "169.254.169.254",
    "metadata.google.internal",
    "10.0.0.1",
    "172.16.5.4",
    "192.168.1.1",
    "100.64.0.1",
    "[fd00::1]",
    "[fe80::1]",
    "224.0.0.1",
    "0.0.0.0",
    "0",
    "[::]",
]


@pytest.mark.parametrize("host", REFUSED)
async def test_every_spelling_of_an_internal_address_is_refused(host: str) -> None:
    policy = OutboundPolicy(resolver=Resolver(dict(LOOPBACK_RESOLVER)))
    with pytest.raises(DestinationNotAllowed) as refused:
        await policy.check_url(f"http://{host}:8080/mcp", ("body", "url"))
    assert refused.value.loc == ("body", "url")


async def test_public_addresses_pass_and_the_allow_list_opens_holes() -> None:
    resolver = Resolver({"mcp.example.com": [["93.184.216.34"]], **LOOPBACK_RESOLVER})
    policy = OutboundPolicy(resolver=resolver)
    found = await policy.check_url("https://mcp.example.com/mcp", ("url",))
    assert [str(a) for a in found.addresses] == ["93.184.216.34"] and found.port == 443
    assert refusal(ipaddress.ip_address("8.8.8.8")) is None

    opened = OutboundPolicy(["127.0.0.1/32", " localhost ", ""], resolver=resolver)
    await opened.check_url("http://127.1:9/x", ("url",))  # the same address, another spelling
    await opened.check_url("http://[::ffff:127.0.0.1]:9/x", ("url",))
    await opened.check_url("http://localhost.:9/x", ("url",))  # a listed name: any address
    with pytest.raises(DestinationNotAllowed):
        await opened.check_url("http://[::1]:9/x", ("url",))
    with pytest.raises(DestinationNotAllowed, match="only http and https"):
        await opened.check_url("file:///etc/passwd", ("url",))


async def test_a_public_looking_name_that_resolves_inside_is_refused() -> None:
    resolver = Resolver(
        {
            "mcp.example.com": [["127.0.0.1"]],
            "mixed.example.com": [["93.184.216.34", "10.1.2.3"]],
            "rebind.example.com": [["93.184.216.34"], ["169.254.169.254"]],
        }
    )
    policy = OutboundPolicy(resolver=resolver)
    with pytest.raises(DestinationNotAllowed, match=r"resolves to 127\.0\.0\.1"):
        await policy.check_url("http://mcp.example.com/", ("url",))
    with pytest.raises(DestinationNotAllowed, match=r"10\.1\.2\.3"):
        await policy.check_url("http://mixed.example.com/", ("url",))


class RecordingBackend(httpcore2.AsyncNetworkBackend):
    """Records what it is asked to dial and the TLS name; answers every request 200."""

    def __init__(self) -> None:
        self.dialled: list[tuple[str, int]] = []
        self.sent = bytearray()
        self.tls_names: list[str | None] = []

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's interface)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        self.dialled.append((host, port))
        return _Stream(self)


class _Stream(httpcore2.AsyncNetworkStream):
    def __init__(self, backend: RecordingBackend) -> None:
        self.backend = backend
        self.answered = False

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:  # noqa: ASYNC109
        if self.answered:
            return b""
        self.answered = True
        return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        self.backend.sent.extend(buffer)

    async def aclose(self) -> None:
        return None

    async def start_tls(
        self,
        ssl_context: Any,
        server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> httpcore2.AsyncNetworkStream:
        self.backend.tls_names.append(server_hostname)
        return self

    def get_extra_info(self, info: str) -> Any:
        return None


async def test_dns_rebinding_the_connection_goes_to_the_address_checked() -> None:
    # First answer public, every later one the metadata address: a check and a
    # second resolution for the connect would connect inside.
    resolver = Resolver({"rebind.example.com": [["93.184.216.34"], ["169.254.169.254"]]})
    policy = OutboundPolicy(resolver=resolver)
    backend = RecordingBackend()
    async with httpx2.AsyncClient(transport=policy.transport(backend=backend)) as client:
        response = await client.get("https://rebind.example.com/mcp")
        assert response.status_code == 200
        # Dialled by address, once resolved; Host and TLS keep the name.
        assert backend.dialled == [("93.184.216.34", 443)]
        assert resolver.calls == ["rebind.example.com"]
        assert b"\r\nHost: rebind.example.com\r\n" in bytes(backend.sent)
        assert backend.tls_names == ["rebind.example.com"]
    # The name now answers inside: a new connection is refused, nothing dialled.
    async with httpx2.AsyncClient(transport=policy.transport(backend=backend)) as client:
        with pytest.raises(DestinationNotAllowed, match=r"169\.254\.169\.254"):
            await client.get("https://rebind.example.com/mcp")
    assert backend.dialled == [("93.184.216.34", 443)]


async def test_a_redirect_to_a_refused_address_is_not_followed() -> None:
    async with Listener("127.0.0.1") as inside:

        def redirect(me: Listener, *_: Any) -> tuple[int, dict[str, str], bytes]:
            return 307, {"Location": f"http://localhost:{inside.port}/admin"}, b""

        async with Listener(ALLOWED_HOST, redirect) as outside:
            policy = OutboundPolicy([f"{ALLOWED_HOST}/32"])
            transport = policy.transport(("url",))
            async with httpx2.AsyncClient(transport=transport, follow_redirects=True) as client:
                with pytest.raises(DestinationNotAllowed, match="loopback"):
                    await client.get(f"{outside.origin}/mcp")
            assert outside.requests == [("GET", "/mcp")]
    assert inside.connections == 0


async def test_the_tool_runners_transport_refuses_before_connecting() -> None:
    async with Listener("127.0.0.1") as inside:
        with pytest.raises(DestinationNotAllowed):
            async with http_transport(
                f"http://127.1:{inside.port}/mcp",
                headers={},
                auth=None,
                timeout_seconds=5,
                outbound=OutboundPolicy([f"{ALLOWED_HOST}/32"]),
            ):
                pass
    assert inside.connections == 0


async def test_oauth_discovery_never_reflects_a_remote_body() -> None:
    """In-process: the registration's 403 body stays out of the error."""
    async with Listener(ALLOWED_HOST) as server:
        server.route = oauth_server(lambda me: f"{me.origin}/register")
        policy = OutboundPolicy([f"{ALLOWED_HOST}/32"])
        async with httpx2.AsyncClient(transport=policy.transport(), timeout=10) as http:
            with pytest.raises(AuthorizationFailed) as failed:
                await begin(http, f"{server.origin}/mcp", OAuthRecord(), "http://gw/cb", name="s")
    assert "403" in str(failed.value) and SECRET not in str(failed.value)
    assert "admin" not in str(failed.value)


# -- through the engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """A gateway and a tool-runner that may reach 127.0.0.2 and nothing else local."""
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}outbound:",
        HOLDFAST_OUTBOUND_ALLOW=f"{ALLOWED_HOST}/32",
        HOLDFAST_ASSET_CONNECT_TIMEOUT_SECONDS="20",
        HOLDFAST_WORKSPACE_ROOT=str(tmp_path_factory.mktemp("outbound-workspaces")),
    )
    directory = tmp_path_factory.mktemp("outbound-engine")
    with running_engine(env, workers=0, runners=1, directory=directory) as procs:
        yield procs


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=90) as c:
        yield c


def _refusal_of(response: httpx.Response, loc: list[str]) -> dict[str, Any]:
    assert response.status_code == 422, response.text
    body: dict[str, Any] = response.json()
    assert body["error"] == "DESTINATION_NOT_ALLOWED", body
    assert [e["loc"] for e in body["details"]["errors"]] == [loc], body
    return body


ENGINE_SPELLINGS = [
    "localhost",
    "[::1]",
    "0x7f000001",
    "2130706433",
    "0177.0.0.1",
    "127.1",
    "[::ffff:127.0.0.1]",
    "0.0.0.0",
    "169.254.169.254",
    "10.0.0.1",
    "192.168.1.1",
    "[fd00::1]",
    "metadata.google.internal",
]


async def test_registering_an_internal_url_is_refused_before_any_packet(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
) -> None:
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    async with Listener("127.0.0.1") as inside, Listener("::1") as inside6:
        for spelling in ENGINE_SPELLINGS:
            port = inside6.port if spelling == "[::1]" else inside.port
            name = f"x-{secrets.token_hex(3)}"
            body = {"name": name, "transport": "streamable-http", "url": ""}
            body["url"] = f"http://{spelling}:{port}/mcp"
            response = await client.post(f"{engine.url}/assets/servers", json=body, headers=headers)
            _refusal_of(response, ["body", "url"])
            got = await client.get(f"{engine.url}/assets/servers/{name}", headers=headers)
            assert got.status_code == 404  # nothing kept
        for spelling, oauth in (("127.1", True), ("localhost", True)):
            body = {
                "name": f"o-{secrets.token_hex(3)}",
                "transport": "streamable-http",
                "url": f"http://{spelling}:{inside.port}/mcp",
                "auth": {"type": "oauth2"} if oauth else {"type": "none"},
            }
            response = await client.post(f"{engine.url}/assets/servers", json=body, headers=headers)
            _refusal_of(response, ["body", "url"])
    assert inside.connections == 0 and inside6.connections == 0


async def test_oauth_metadata_naming_an_internal_registration_endpoint_is_refused(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
) -> None:
    headers = {"X-Engine-Key": api_keys["main"]}
    async with Listener("127.0.0.1") as inside, Listener(ALLOWED_HOST) as server:
        server.route = oauth_server(lambda _: f"http://127.0.0.1:{inside.port}/register")
        name = f"o-{secrets.token_hex(3)}"
        body = {
            "name": name,
            "transport": "streamable-http",
            "url": f"{server.origin}/mcp",
            "auth": {"type": "oauth2"},
        }
        created = await client.post(f"{engine.url}/assets/servers", json=body, headers=headers)
        assert created.status_code == 201, created.text
        response = await client.get(f"{engine.url}/assets/servers/{name}/connect", headers=headers)
        _refusal_of(response, ["authorization_server_metadata", "registration_endpoint"])
        assert ("GET", "/.well-known/oauth-authorization-server") in server.requests
    assert inside.connections == 0


async def test_a_refused_registration_body_never_reaches_the_tenant(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
) -> None:
    headers = {"X-Engine-Key": api_keys["main"]}
    async with Listener(ALLOWED_HOST) as server:
        server.route = oauth_server(lambda me: f"{me.origin}/register")
        name = f"o-{secrets.token_hex(3)}"
        body = {
            "name": name,
            "transport": "streamable-http",
            "url": f"{server.origin}/mcp",
            "auth": {"type": "oauth2"},
        }
        created = await client.post(f"{engine.url}/assets/servers", json=body, headers=headers)
        assert created.status_code == 201, created.text
        response = await client.get(f"{engine.url}/assets/servers/{name}/connect", headers=headers)
        assert ("POST", "/register") in server.requests
    assert response.status_code == 422, response.text
    assert response.json()["error"] == "ASSET_UNAVAILABLE"
    assert "403" in response.json()["message"]
    for part in (SECRET, "INTERNAL-SECRET", "admin panel"):
        assert part not in response.text


async def test_an_allowed_server_is_still_reached(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    client: httpx.AsyncClient,
) -> None:
    """The allow-list lets 127.0.0.2 through: the probe reaches it (and finds no MCP server)."""
    headers = {"X-Engine-Key": api_keys["main"]}
    async with Listener(ALLOWED_HOST) as server:
        body = {"name": f"n-{secrets.token_hex(3)}", "transport": "streamable-http"}
        body["url"] = f"{server.origin}/mcp"
        response = await client.post(f"{engine.url}/assets/servers", json=body, headers=headers)
        assert response.status_code == 422 and response.json()["error"] == "ASSET_UNAVAILABLE"
        assert server.connections >= 1
