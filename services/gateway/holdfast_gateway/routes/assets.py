"""``/assets``: the tenant's Asset Directory — MCP servers and their stored credentials.

``POST /assets/servers`` registers a server (streamable HTTP at a ``url``, or a
``command`` run over stdio inside the sandbox) and answers 201 with the tools
it offers: a tool-runner connects with the SDK and lists them (``AssetProbe``:
the gateway itself never runs a server's command). A server that cannot be
listed is not kept (422 ``ASSET_UNAVAILABLE`` naming its ``url`` or
``command``; 503 if no tool-runner answered). An ``oauth2``
server is kept before any authorization: 201 with ``status:
needs_authorization`` and no tools, until ``GET /assets/servers/{name}/connect``
(the authorization URL: OAuth 2.1 + PKCE, discovered from the server) and the
user's visit to the authorization server, which comes back to ``GET
/assets/oauth/callback``: the tokens are stored and the tools listed.

Credentials — a bearer token, OAuth client secrets and tokens, a stdio server's
``env`` values — are sealed before they are stored (``HOLDFAST_ASSET_ENCRYPTION_KEY``)
and never answered: a server is described with its ``env`` names and its auth
type only. Another tenant's servers answer 404 ``ASSET_NOT_FOUND``, as names
that do not exist do; so does a callback whose ``state`` no authorization waits for.

Every URL the gateway or a tool-runner would connect to for the tenant passes
the outbound policy (``holdfast_shared.outbound``, ``HOLDFAST_OUTBOUND_ALLOW``):
a ``url`` leading to loopback, private or metadata addresses is 422
``DESTINATION_NOT_ALLOWED`` naming it before anything is sent or stored, and so
is an OAuth endpoint a server's metadata names. Errors say what status a remote
answered, never its body.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Annotated, Any, Literal

import httpx2
from fastapi import APIRouter, Body, Path, Query, Request, Response
from holdfast_shared.assets import (
    MAX_SERVER_NAME,
    NEEDS_AUTHORIZATION,
    READY,
    SERVER_NAME_PATTERN,
    Vault,
    find_server,
    model_name,
    tenant_servers,
)
from holdfast_shared.assets.catalogue import annotation_effect
from holdfast_shared.assets.oauth import OAuthRecord
from holdfast_shared.assets.servers import AuthType, open_oauth, seal_credentials
from holdfast_shared.content import Text
from holdfast_shared.db.models import AssetServer
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import new_id
from holdfast_shared.jobs import AssetProbe, AssetProbeResult
from holdfast_shared.outbound import DestinationNotAllowed, OutboundPolicy
from holdfast_shared.redisconn import blpop_within
from holdfast_shared.tools import Effect
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert

from holdfast_gateway import errors
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep
from holdfast_gateway.errors import ApiError
from holdfast_gateway.oauthflow import AuthorizationFailed, begin, complete
from holdfast_gateway.state import GatewayState

router = APIRouter(tags=["assets"])

MAX_ARGS = 64
MAX_ENV = 64
MAX_EFFECTS = 256
CALLBACK_PATH = "/assets/oauth/callback"

_ServerName = Annotated[str, Field(pattern=SERVER_NAME_PATTERN, max_length=MAX_SERVER_NAME)]
_Secret = Annotated[Text, Field(min_length=1, max_length=8192)]
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
_EnvName = Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=128)]


class NoAuth(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["none"]


class BearerAuth(BaseModel):
    """A static token, sent as ``Authorization: Bearer <token>``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["bearer"]
    token: _Secret


class OAuth2Auth(BaseModel):
    """OAuth 2.1 + PKCE per the MCP authorization spec; without ``client_id`` the
    client registers itself dynamically with the server's authorization server."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["oauth2"]
    client_id: Annotated[Text, Field(min_length=1, max_length=512)] | None = None
    client_secret: _Secret | None = None
    scope: Annotated[Text, Field(min_length=1, max_length=2048)] | None = None


Auth = Annotated[NoAuth | BearerAuth | OAuth2Auth, Field(discriminator="type")]


class _NewServer(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[
        _ServerName,
        Field(description="unique among the tenant's; its tools reach the model as name__tool"),
    ]
    effects: Annotated[
        # No NUL: PostgreSQL refuses it in a JSONB key (a 422 here, not a 500 there).
        dict[Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[^\x00]+$")], Effect],
        Field(
            max_length=MAX_EFFECTS,
            description="effect classes by the server's own tool names, over what its MCP "
            "annotations give (readOnlyHint: read_only, idempotentHint: idempotent, else "
            "effectful); an agent's `effects` win over these",
            # pydantic describes the key's pattern as patternProperties, which leaves
            # any other key free: say that there is none (Schemathesis, ST901).
            json_schema_extra={"additionalProperties": False},
        ),
    ] = {}


class HttpServer(_NewServer):
    """A server reached over streamable HTTP, with its credentials if it needs any."""

    transport: Literal["streamable-http"]
    # Only its form is checked here; where it leads, by the outbound policy (422
    # DESTINATION_NOT_ALLOWED); whether an MCP server answers there, by the probe
    # (422 ASSET_UNAVAILABLE naming it if not).
    url: Annotated[
        str, Field(pattern=r"^https?://[!-~]+$", max_length=2048, description="its MCP endpoint")
    ]
    auth: Auth = NoAuth(type="none")


class StdioServer(_NewServer):
    """A server run as a command, talked to over its stdin and stdout, inside the
    task's sandbox (network only if the agent has it)."""

    transport: Literal["stdio"]
    command: Annotated[
        Text, Field(min_length=1, max_length=4096, description="the program (PATH-searched)")
    ]
    args: Annotated[list[Annotated[Text, Field(max_length=4096)]], Field(max_length=MAX_ARGS)] = []
    env: Annotated[
        dict[_EnvName, Annotated[Text, Field(max_length=8192)]],
        Field(
            max_length=MAX_ENV,
            description="added to its environment; stored encrypted",
            json_schema_extra={
                # Every key a variable name, every value text: nothing else.
                "propertyNames": {"pattern": ENV_NAME_PATTERN, "maxLength": 128},
                "additionalProperties": False,
            },
        ),
    ] = {}


NewServer = Annotated[HttpServer | StdioServer, Field(discriminator="transport")]
"""``POST /assets/servers``'s body: by ``transport``."""


class ToolInfo(BaseModel):
    name: str
    model_name: str
    description: str
    inputSchema: dict[str, Any]  # the MCP field's name
    annotations: dict[str, Any]
    effect: Annotated[
        Effect,
        Field(
            description="what the engine may do when a call's outcome is unknown: run a "
            "read_only or idempotent tool again (same idempotency key), have a person "
            "settle an effectful one"
        ),
    ]


class AuthInfo(BaseModel):
    type: AuthType
    authorized: bool


class ServerSummary(BaseModel):
    name: str
    transport: str
    url: str | None
    command: str | None
    args: list[str]
    env: list[str]
    auth: AuthInfo
    status: Literal["ready", "needs_authorization"]
    tool_count: int
    # Epoch ms.
    tools_listed_at: int | None
    created_at: int
    updated_at: int


class Server(ServerSummary):
    tools: list[ToolInfo]


class ServerList(BaseModel):
    servers: list[ServerSummary]


class ServerTools(BaseModel):
    server: str
    tools: list[ToolInfo]


class Connect(BaseModel):
    server: str
    authorization_url: str
    redirect_uri: str
    # Epoch ms: the URL's callback is refused after it.
    expires_at: int


class Connected(BaseModel):
    server: str
    status: Literal["ready"]
    tools: list[ToolInfo]
    # The tools could not be listed yet (the tokens are stored all the same).
    error: str | None = None


def _ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def _tools(row: AssetServer) -> list[dict[str, Any]]:
    overrides = row.effects or {}
    return [
        {
            **tool,
            "model_name": model_name(row.name, str(tool.get("name"))),
            "effect": overrides.get(str(tool.get("name")))
            or annotation_effect(tool.get("annotations") or {}),
        }
        for tool in row.tools
    ]


def _describe(state: GatewayState, row: AssetServer, *, tools: bool) -> dict[str, Any]:
    env = list(state.vault.open(row.env)) if row.env and state.vault else []
    authorized = row.auth_type != "oauth2" or row.status == READY
    described: dict[str, Any] = {
        "name": row.name,
        "transport": row.transport,
        "url": row.url,
        "command": row.command,
        "args": list(row.args),
        "env": env,
        "auth": {"type": row.auth_type, "authorized": authorized},
        "status": row.status,
        "tool_count": len(row.tools),
        "tools_listed_at": _ms(row.tools_listed_at) if row.tools_listed_at else None,
        "created_at": _ms(row.created_at),
        "updated_at": _ms(row.updated_at),
    }
    if tools:
        described["tools"] = _tools(row)
    return described


def not_found(name: str) -> ApiError:
    return ApiError(
        404,
        ErrorCode.ASSET_NOT_FOUND,
        f"Asset Directory server {name!r} not found",
        {"server": name},
    )


def _unavailable(body: HttpServer | StdioServer, result: AssetProbeResult) -> ApiError:
    """The answer to a registration whose server could not be listed.

    422 naming the field that leads to it (the ``url``, the ``command``): the
    request is well-formed, but what it names does not answer as an MCP server
    (as ``MODEL_UNAVAILABLE`` is for a model no worker serves). 503 when no
    tool-runner answered at all: the engine's side, to retry.
    """
    if result.no_runner:
        return ApiError(
            503,
            ErrorCode.UNAVAILABLE,
            f"{result.error}; nothing was stored, retry shortly",
            headers={"Retry-After": "5"},
        )
    field = "url" if isinstance(body, HttpServer) else "command"
    message = f"cannot list the tools of {body.name!r}: {result.error}; nothing was stored"
    problem: dict[str, Any] = {"loc": ["body", field], "msg": result.error, "type": "unreachable"}
    details: dict[str, Any] = {"server": body.name, "errors": [problem]}
    if result.needs_authorization:
        details["needs_authorization"] = True
    if result.stderr:
        # Why a stdio server did not start (a missing module, a path the sandbox
        # hides): the last 4 KiB it wrote to stderr, redacted of its secrets.
        details["stderr"] = result.stderr
    return ApiError(422, ErrorCode.ASSET_UNAVAILABLE, message, details)


def _not_allowed(exc: DestinationNotAllowed, server: str) -> ApiError:
    """422 naming the field whose URL the outbound policy refused."""
    problem = {"loc": list(exc.loc), "msg": exc.reason, "type": "destination_not_allowed"}
    return ApiError(
        422,
        ErrorCode.DESTINATION_NOT_ALLOWED,
        f"{server!r}: the engine may not connect there: {exc.reason}",
        {"server": server, "errors": [problem]},
    )


def _outbound(state: GatewayState) -> OutboundPolicy:
    return OutboundPolicy.from_settings(state.settings)


async def _probe(state: GatewayState, tenant: str, name: str) -> AssetProbeResult:
    """Have a tool-runner connect to the server and list its tools."""
    reply = state.keys.asset_probe_reply(new_id("probe"))
    probe = AssetProbe(tenant_id=tenant, server=name, reply_to=reply)
    await state.redis.xadd(state.keys.tools, probe.to_fields())
    wait = int(state.settings.asset_connect_timeout_seconds) + 15
    got = await blpop_within(state.redis, [reply], wait)
    if got is None:
        return AssetProbeResult(error=f"no tool-runner answered within {wait} s", no_runner=True)
    return AssetProbeResult.model_validate_json(got[1])


async def _store_tools(state: GatewayState, tenant: str, name: str, tools: list[Any]) -> None:
    async with state.sessions.begin() as session:
        await session.execute(
            update(AssetServer)
            .where(AssetServer.tenant_id == tenant, AssetServer.name == name)
            .values(tools=tools, tools_listed_at=func.now(), status=READY)
        )


def _vault(state: GatewayState) -> Vault:
    assert state.vault is not None, "the gateway starts only with HOLDFAST_ASSET_ENCRYPTION_KEY"
    return state.vault


_NAME = Annotated[str, Path(pattern=SERVER_NAME_PATTERN, max_length=MAX_SERVER_NAME)]


@router.post(
    "/assets/servers",
    status_code=201,
    response_model=Server,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 409),
    summary="Register an MCP server: its tools are listed at once (oauth2: after /connect)",
)
async def register_server(
    state: StateDep, tenant: TenantDep, body: Annotated[NewServer, Body()]
) -> dict[str, Any]:
    """201 with the server and its tools; 422 ``ASSET_UNAVAILABLE`` (naming ``url``
    or ``command``) when it cannot be listed, and then nothing is kept."""
    vault = _vault(state)
    if isinstance(body, HttpServer):
        try:
            await _outbound(state).check_url(body.url, ("body", "url"))
        except DestinationNotAllowed as exc:
            raise _not_allowed(exc, body.name) from None
    auth = body.auth if isinstance(body, HttpServer) else NoAuth(type="none")
    if isinstance(auth, BearerAuth):
        credentials = seal_credentials(vault, "bearer", auth.token)
    elif isinstance(auth, OAuth2Auth):
        record = OAuthRecord(
            client_id=auth.client_id, client_secret=auth.client_secret, scope=auth.scope
        )
        credentials = seal_credentials(vault, "oauth2", record)
    else:
        credentials = None
    oauth = auth.type == "oauth2"
    async with state.sessions.begin() as session:
        row = await session.scalar(
            insert(AssetServer)
            .values(
                tenant_id=tenant,
                name=body.name,
                transport=body.transport,
                url=body.url if isinstance(body, HttpServer) else None,
                command=body.command if isinstance(body, StdioServer) else None,
                args=body.args if isinstance(body, StdioServer) else [],
                env=vault.seal(body.env) if isinstance(body, StdioServer) and body.env else None,
                auth_type=auth.type,
                credentials=credentials,
                status=NEEDS_AUTHORIZATION if oauth else READY,
                effects=dict(body.effects),
            )
            .on_conflict_do_nothing()
            .returning(AssetServer.name)
        )
    if row is None:
        raise ApiError(
            409,
            ErrorCode.ASSET_EXISTS,
            f"Asset Directory server {body.name!r} exists; DELETE it first to register it anew",
            {"server": body.name},
        )
    if not oauth:
        result = await _probe(state, tenant, body.name)
        if result.error is not None:
            async with state.sessions.begin() as session:
                await session.execute(
                    delete(AssetServer).where(
                        AssetServer.tenant_id == tenant, AssetServer.name == body.name
                    )
                )
            raise _unavailable(body, result)
        await _store_tools(state, tenant, body.name, result.tools)
    async with state.sessions() as session:
        stored = await find_server(session, tenant, body.name)
    if stored is None:  # deleted meanwhile
        raise not_found(body.name)
    return _describe(state, stored, tools=True)


@router.get(
    "/assets/servers",
    response_model=ServerList,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="The tenant's MCP servers",
)
async def list_servers(state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    async with state.sessions() as session:
        rows = await tenant_servers(session, tenant)
    return {"servers": [_describe(state, row, tools=False) for row in rows]}


@router.get(
    "/assets/servers/{name}",
    response_model=Server,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="One MCP server, with its tools",
)
async def get_server(state: StateDep, tenant: TenantDep, name: _NAME) -> dict[str, Any]:
    async with state.sessions() as session:
        row = await find_server(session, tenant, name)
    if row is None:
        raise not_found(name)
    return _describe(state, row, tools=True)


@router.get(
    "/assets/servers/{name}/tools",
    response_model=ServerTools,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="The tools an MCP server offered when last listed",
)
async def server_tools(state: StateDep, tenant: TenantDep, name: _NAME) -> dict[str, Any]:
    async with state.sessions() as session:
        row = await find_server(session, tenant, name)
    if row is None:
        raise not_found(name)
    return {"server": row.name, "tools": _tools(row)}


@router.delete(
    "/assets/servers/{name}",
    status_code=204,
    response_class=Response,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="Remove an MCP server and its credentials",
)
async def delete_server(state: StateDep, tenant: TenantDep, name: _NAME) -> Response:
    async with state.sessions.begin() as session:
        deleted = await session.scalar(
            delete(AssetServer)
            .where(AssetServer.tenant_id == tenant, AssetServer.name == name)
            .returning(AssetServer.name)
        )
    if deleted is None:
        raise not_found(name)
    return Response(status_code=204)


def _redirect_uri(state: GatewayState, request: Request) -> str:
    base = state.settings.public_url or str(request.base_url)
    return base.rstrip("/") + CALLBACK_PATH


def _state_hash(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _http(state: GatewayState) -> httpx2.AsyncClient:
    """A client for a tenant's destinations: every connection judged and pinned."""
    return httpx2.AsyncClient(
        timeout=state.settings.asset_connect_timeout_seconds,
        transport=_outbound(state).transport(),
    )


@router.get(
    "/assets/servers/{name}/connect",
    response_model=Connect,
    responses=errors.responses(*errors.AUTHENTICATED, 404, 409),
    summary="The URL to authorize an oauth2 server at (OAuth 2.1 + PKCE)",
)
async def connect_server(
    state: StateDep, tenant: TenantDep, name: _NAME, request: Request
) -> dict[str, Any]:
    vault = _vault(state)
    async with state.sessions() as session:
        row = await find_server(session, tenant, name)
    if row is None:
        raise not_found(name)
    if row.auth_type != "oauth2" or row.url is None:
        raise ApiError(
            409,
            ErrorCode.ASSET_NOT_OAUTH2,
            f"{name!r} does not use oauth2: there is nothing to connect",
            {"server": name},
        )
    redirect_uri = _redirect_uri(state, request)
    try:
        async with _http(state) as http:
            url, record = await begin(
                http, row.url, open_oauth(vault, row.credentials), redirect_uri, name=name
            )
    except DestinationNotAllowed as exc:
        raise _not_allowed(exc, name) from None
    except AuthorizationFailed as exc:
        # As for a registration: the request is sound, what it leads to does not answer.
        raise ApiError(
            422,
            ErrorCode.ASSET_UNAVAILABLE,
            f"cannot prepare the authorization of {name!r}: {exc}",
            {
                "server": name,
                "errors": [{"loc": ["path", "name"], "msg": str(exc), "type": "unreachable"}],
            },
        ) from None
    assert record.pending is not None
    async with state.sessions.begin() as session:
        await session.execute(
            update(AssetServer)
            .where(AssetServer.tenant_id == tenant, AssetServer.name == name)
            .values(
                credentials=seal_credentials(vault, "oauth2", record),
                oauth_state=_state_hash(record.pending.state),
            )
        )
    return {
        "server": name,
        "authorization_url": url,
        "redirect_uri": redirect_uri,
        "expires_at": int(record.pending.expires_at * 1000),
    }


def _callback_failed(message: str) -> ApiError:
    return ApiError(400, ErrorCode.ASSET_AUTHORIZATION_FAILED, message)


@router.get(
    CALLBACK_PATH,
    response_model=Connected,
    responses=errors.responses(400, 404, 422, 500, 503),
    summary="Where the authorization server sends the user back (no API key: the state "
    "names the server)",
)
async def oauth_callback(
    state: StateDep,
    oauth_state: Annotated[str, Query(alias="state", min_length=1, max_length=512)],
    code: Annotated[str | None, Query(max_length=4096)] = None,
    error: Annotated[str | None, Query(max_length=256)] = None,
) -> dict[str, Any]:
    vault = _vault(state)
    hashed = _state_hash(oauth_state)
    async with state.sessions() as session:
        row = await session.scalar(select(AssetServer).where(AssetServer.oauth_state == hashed))
    if row is None or row.url is None:
        raise ApiError(
            404,
            ErrorCode.ASSET_NOT_FOUND,
            "no authorization of an Asset Directory server is waiting for this state "
            "(used already, or never handed out)",
        )
    tenant, name = row.tenant_id, row.name
    if error is not None or not code:
        await _forget_pending(state, row, vault)
        reason = error if error and error.isascii() and error.isprintable() else "no code"
        raise _callback_failed(f"the authorization of {name!r} was not granted ({reason})")
    try:
        async with _http(state) as http:
            record = await complete(
                http, row.url, open_oauth(vault, row.credentials), code=code, state=oauth_state
            )
    except DestinationNotAllowed as exc:
        await _forget_pending(state, row, vault)
        raise _not_allowed(exc, name) from None
    except AuthorizationFailed as exc:
        await _forget_pending(state, row, vault)
        raise _callback_failed(f"the authorization of {name!r} failed: {exc}") from None
    async with state.sessions.begin() as session:
        await session.execute(
            update(AssetServer)
            .where(
                AssetServer.tenant_id == tenant,
                AssetServer.name == name,
                AssetServer.oauth_state == hashed,
            )
            .values(
                credentials=seal_credentials(vault, "oauth2", record),
                oauth_state=None,
                status=READY,
            )
        )
    result = await _probe(state, tenant, name)
    if result.error is None:
        await _store_tools(state, tenant, name, result.tools)
    async with state.sessions() as session:
        stored = await find_server(session, tenant, name)
    if stored is None:
        raise _callback_failed(f"{name!r} was deleted during its authorization")
    return {"server": name, "status": READY, "tools": _tools(stored), "error": result.error}


async def _forget_pending(state: GatewayState, row: AssetServer, vault: Vault) -> None:
    record = open_oauth(vault, row.credentials).model_copy(update={"pending": None})
    async with state.sessions.begin() as session:
        await session.execute(
            update(AssetServer)
            .where(AssetServer.tenant_id == row.tenant_id, AssetServer.name == row.name)
            .values(credentials=seal_credentials(vault, "oauth2", record), oauth_state=None)
        )
