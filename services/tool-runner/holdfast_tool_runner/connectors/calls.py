"""Calling a tenant's MCP servers: a tool call of a task, or a probe of a server.

:class:`Connectors` looks the server up for the job's tenant (PostgreSQL;
another tenant's server is simply not found), opens its credentials
(``HOLDFAST_ASSET_ENCRYPTION_KEY``), takes the task's session from
:class:`~holdfast_tool_runner.connectors.sessions.Sessions` or opens one, and
calls. Whatever goes wrong — the server is down, times out, dies mid-call,
wants authorization again — is an outcome with an ``error`` for the model,
never an exception: the turn goes on. Outputs and errors are redacted of the
server's secrets (``outcomes.Redactor``).

A stdio server runs in the task's sandbox (its workspace, the agent's network
setting, the operator's ``HOLDFAST_ASSET_STDIO_PATHS`` read-only); an HTTP
server is reached from the runner with its credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
from holdfast_shared.assets import (
    NEEDS_AUTHORIZATION,
    ServerConfig,
    Vault,
    VaultError,
    find_server,
    open_server,
)
from holdfast_shared.assets.catalogue import listed_tool
from holdfast_shared.assets.oauth import OAuthRecord
from holdfast_shared.assets.servers import open_oauth, seal_credentials
from holdfast_shared.db.models import AssetServer
from holdfast_shared.jobs import AssetProbeResult, ToolCallJob, ToolOutcome
from holdfast_shared.outbound import DestinationNotAllowed, OutboundPolicy
from mcp import Client, MCPError
from mcp.client._transport import TransportStreams
from mcp_types import CONNECTION_CLOSED
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_tool_runner.connectors.oauthbearer import NeedsAuthorization, StoredOAuth
from holdfast_tool_runner.connectors.outcomes import Redactor, call_outcome
from holdfast_tool_runner.connectors.sessions import SessionKey, Sessions
from holdfast_tool_runner.connectors.transports import http_transport, resident_transport
from holdfast_tool_runner.sandbox import (
    Launchers,
    Resident,
    SandboxPolicy,
    SandboxUnavailable,
    start_resident,
)
from holdfast_tool_runner.workspaces import WorkspaceError, Workspaces

log = logging.getLogger(__name__)

# The workspace a probe's stdio server runs in (no task yet): per tenant.
PROBE_TASK = "asset-probe"
# How long a stdio server's sandbox may live: well past any idle timeout.
_RESIDENT_SECONDS = 24 * 3600.0
# How long a call may use a server's row and credentials read before (_server).
_SERVER_CACHE_SECONDS = 2.0
_SERVER_CACHE_SIZE = 1024


class _Unavailable(Exception):
    """The server cannot be used now; the message is for the model (no secret)."""


def _version(row: AssetServer) -> str:
    """What a session was opened for: a changed registration gets a new session."""
    fields = (row.transport, row.url, row.command, repr(row.args), row.env, row.auth_type)
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def _secrets(config: ServerConfig) -> list[str]:
    found = [value.get_secret_value() for value in config.env.values()]
    if config.bearer is not None:
        found.append(config.bearer.get_secret_value())
    record = config.oauth
    if record is not None:
        if record.tokens is not None:
            found.append(record.tokens.access_token)
            if record.tokens.refresh_token:
                found.append(record.tokens.refresh_token)
        for secret in (
            record.client_secret,
            record.client_info and record.client_info.client_secret,
        ):
            if secret:
                found.append(secret)
    return found


def _describe(exc: BaseException) -> str:
    """Why a call failed, in words that hold nothing of the request (URLs can hold keys)."""
    if isinstance(exc, BaseExceptionGroup):
        inner = exc.exceptions[0] if exc.exceptions else exc
        return _describe(inner)
    if isinstance(exc, NeedsAuthorization):
        return str(exc)
    if isinstance(exc, DestinationNotAllowed):
        return f"the engine may not connect there: {exc.reason}"
    if isinstance(exc, MCPError):
        if exc.error.code == CONNECTION_CLOSED:
            return f"the connection to the server was lost ({exc.error.message})"
        return f"the server answered an error: {exc.error.message}"
    if isinstance(exc, httpx2.InvalidURL | httpx2.UnsupportedProtocol):
        return "the url is not one an HTTP client can reach"
    if isinstance(exc, httpx2.ConnectError | ConnectionError):
        return "cannot connect to the server (is it running?)"
    if isinstance(exc, httpx2.TimeoutException):
        return "the server did not answer in time"
    if isinstance(exc, httpx2.HTTPStatusError):
        return f"the server answered HTTP {exc.response.status_code}"
    return f"the connection to the server failed ({type(exc).__name__})"


class Connectors:
    """This runner's way to its tenants' MCP servers (see the module docstring)."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        vault: Vault | None,
        workspaces: Workspaces,
        *,
        launchers: Launchers | None,
        stdio_paths: tuple[Path, ...],
        idle_seconds: float,
        connect_timeout: float,
        outbound: OutboundPolicy,
    ) -> None:
        self.db = sessions
        self.vault = vault
        self.workspaces = workspaces
        self.launchers = launchers
        self.stdio_paths = stdio_paths
        self.connect_timeout = connect_timeout
        self.outbound = outbound
        self.sessions = Sessions(idle_seconds=idle_seconds)
        # (tenant, server) → (until, row, opened config): see _server.
        self._opened: dict[tuple[str, str], tuple[float, AssetServer, ServerConfig]] = {}
        # Each open session's OAuth (none for other auth types).
        self._auth: dict[SessionKey, list[StoredOAuth]] = {}

    # -- tool calls ------------------------------------------------------------
    async def call(self, job: ToolCallJob) -> ToolOutcome:
        """Run ``job`` (an MCP tool call) on its server; failures are outcomes."""
        assert job.server is not None
        redactor = Redactor(())
        key = SessionKey(job.tenant_id, job.task_id, job.server)
        try:
            row, config = await self._server(job.tenant_id, job.server)
            redactor = Redactor(_secrets(config))
            tool = job.server_tool or job.tool
            client = await self._client(key, row, config, network=job.network)
            try:
                async with asyncio.timeout(job.timeout_seconds):
                    result = await client.call_tool(
                        tool, job.input, read_timeout_seconds=job.timeout_seconds
                    )
            except TimeoutError:
                await self.sessions.discard(key)
                raise _Unavailable(
                    f"the MCP server {job.server!r} did not answer within {job.timeout_seconds:g} s"
                ) from None
            except Exception as exc:
                await self.sessions.discard(key)
                raise _Unavailable(f"MCP server {job.server!r}: {_describe(exc)}") from None
            self.sessions.touch(key)
            return redactor.outcome(call_outcome(result))
        except _Unavailable as exc:
            if any(a.needs_authorization for a in self._auth.get(key, ())):
                await self._refused(job.tenant_id, job.server)
            return redactor.outcome(ToolOutcome(error=str(exc)))

    # -- probes ----------------------------------------------------------------
    async def probe(self, tenant_id: str, server: str) -> AssetProbeResult:
        """Connect to the server, list its tools (every page) and close again."""
        redactor = Redactor(())
        try:
            row, config = await self._server(tenant_id, server, fresh=True)
            redactor = Redactor(_secrets(config))
            auth: list[StoredOAuth] = []
            async with asyncio.timeout(self.connect_timeout):
                async with self._open(row, config, PROBE_TASK, network=False, auth=auth) as client:
                    tools: list[dict[str, Any]] = []
                    cursor: str | None = None
                    for _ in range(100):
                        page = await client.list_tools(cursor=cursor)
                        tools.extend(listed_tool(tool) for tool in page.tools)
                        cursor = page.next_cursor
                        if cursor is None:
                            break
            return AssetProbeResult(tools=redactor.value(tools))
        except _Unavailable as exc:
            return AssetProbeResult(error=redactor.text(str(exc)))
        except TimeoutError:
            return AssetProbeResult(
                error=f"the server did not answer within {self.connect_timeout:g} s"
            )
        except NeedsAuthorization as exc:
            return AssetProbeResult(error=str(exc), needs_authorization=True)
        except Exception as exc:
            needs = any(a.needs_authorization for a in auth)
            return AssetProbeResult(error=redactor.text(_describe(exc)), needs_authorization=needs)

    # -- opening ---------------------------------------------------------------
    async def _server(
        self, tenant_id: str, name: str, *, fresh: bool = False
    ) -> tuple[AssetServer, ServerConfig]:
        """The server's row and opened credentials, read again after
        :data:`_SERVER_CACHE_SECONDS`: the calls of a turn come one after
        another, and a database read and a decryption each would be a good part
        of a call's cost beyond the server. A changed or deleted registration
        reaches calls within that time (a session opened since uses the new one);
        ``fresh`` (a probe, which follows a registration or an authorization)
        reads it now."""
        if self.vault is None:
            raise _Unavailable(
                "the Asset Directory is not configured on this tool-runner "
                "(HOLDFAST_ASSET_ENCRYPTION_KEY)"
            )
        cache_key = (tenant_id, name)
        cached = self._opened.get(cache_key)
        now = time.monotonic()
        if cached is not None and cached[0] > now and not fresh:
            return cached[1], cached[2]
        async with self.db() as session:
            row = await find_server(session, tenant_id, name)
        if row is None:
            self._opened.pop(cache_key, None)
            raise _Unavailable(f"there is no Asset Directory server {name!r} (any more)")
        try:
            config = open_server(row, self.vault)
        except VaultError as exc:
            raise _Unavailable(str(exc)) from None
        if len(self._opened) >= _SERVER_CACHE_SIZE:
            self._opened.clear()  # bounded; rebuilt by the next calls
        self._opened[cache_key] = (now + _SERVER_CACHE_SECONDS, row, config)
        return row, config

    async def _client(
        self, key: SessionKey, row: AssetServer, config: ServerConfig, *, network: bool
    ) -> Client:
        def opener() -> contextlib.AbstractAsyncContextManager[Client]:
            # The session's OAuth, kept to tell afterwards whether it was refused.
            auth: list[StoredOAuth] = []
            self._auth[key] = auth
            return self._open(row, config, key.task_id, network=network, auth=auth)

        try:
            async with asyncio.timeout(self.connect_timeout):
                return await self.sessions.client(
                    key, _version(row), opener, local=config.transport == "stdio"
                )
        except TimeoutError:
            raise _Unavailable(
                f"cannot connect to the MCP server {config.name!r}: no answer within "
                f"{self.connect_timeout:g} s"
            ) from None
        except (_Unavailable, NeedsAuthorization) as exc:
            raise _Unavailable(f"MCP server {config.name!r}: {exc}") from None
        except Exception as exc:
            raise _Unavailable(
                f"cannot connect to the MCP server {config.name!r}: {_describe(exc)}"
            ) from None

    @contextlib.asynccontextmanager
    async def _open(
        self,
        row: AssetServer,
        config: ServerConfig,
        task_id: str,
        *,
        network: bool,
        auth: list[StoredOAuth],
    ) -> AsyncIterator[Client]:
        """A connected, initialised client of the server (its transport closed after)."""
        async with self._transport(config, task_id, network=network, auth=auth) as streams:
            transport = _Ready(streams)
            async with Client(transport, read_timeout_seconds=self.connect_timeout) as client:
                yield client

    @contextlib.asynccontextmanager
    async def _transport(
        self, config: ServerConfig, task_id: str, *, network: bool, auth: list[StoredOAuth]
    ) -> AsyncIterator[TransportStreams]:
        if config.transport == "stdio":
            resident = await self._start_stdio(config, task_id, network=network)
            async with resident_transport(resident) as streams:
                yield streams
            return
        assert config.url is not None
        headers: dict[str, str] = {}
        oauth: StoredOAuth | None = None
        if config.auth_type == "bearer" and config.bearer is not None:
            headers["Authorization"] = f"Bearer {config.bearer.get_secret_value()}"
        elif config.auth_type == "oauth2":
            record = config.oauth or OAuthRecord()
            if not record.authorized:
                raise NeedsAuthorization(
                    "the server is not authorized yet; connect it first "
                    "(GET /assets/servers/{name}/connect)"
                )
            oauth = self._oauth(config, record)
            auth.append(oauth)
        async with http_transport(
            config.url,
            headers=headers,
            auth=oauth,
            timeout_seconds=self.connect_timeout,
            outbound=self.outbound,
        ) as streams:
            yield streams

    async def _start_stdio(self, config: ServerConfig, task_id: str, *, network: bool) -> Resident:
        assert config.command is not None
        try:
            workspace = await asyncio.to_thread(self.workspaces.ensure, config.tenant_id, task_id)
        except WorkspaceError as exc:
            raise _Unavailable(f"workspace unavailable, the server did not start: {exc}") from None
        policy = SandboxPolicy(
            workspace=workspace,
            network=network,
            timeout_seconds=_RESIDENT_SECONDS,
            read_only_paths=self.stdio_paths,
        )
        try:
            return await start_resident(
                [config.command, *config.args],
                policy,
                env=config.plain_env(),
                launchers=self.launchers,
            )
        except SandboxUnavailable as exc:
            raise _Unavailable(f"sandbox unavailable, the server did not start: {exc}") from None

    async def _refused(self, tenant_id: str, name: str) -> None:
        """The server's authorization was revoked (its refresh refused): it
        needs connecting again, and its tools leave the agents' tool lists
        (only a ready server's are offered) until the user does."""
        self._opened.pop((tenant_id, name), None)
        async with self.db.begin() as session:
            await session.execute(
                update(AssetServer)
                .where(AssetServer.tenant_id == tenant_id, AssetServer.name == name)
                .values(status=NEEDS_AUTHORIZATION, updated_at=AssetServer.updated_at)
            )
        log.warning("MCP server %s of tenant %s needs authorization again", name, tenant_id)

    def _oauth(self, config: ServerConfig, record: OAuthRecord) -> StoredOAuth:
        assert config.url is not None and self.vault is not None
        vault = self.vault

        async def save(updated: OAuthRecord) -> None:
            async with self.db.begin() as session:
                await session.execute(
                    update(AssetServer)
                    .where(
                        AssetServer.tenant_id == config.tenant_id,
                        AssetServer.name == config.name,
                    )
                    # Not a new registration: the sessions of this version stay.
                    .values(
                        credentials=seal_credentials(vault, "oauth2", updated),
                        updated_at=AssetServer.updated_at,
                    )
                )

        async def reload() -> OAuthRecord | None:
            async with self.db() as session:
                row = await find_server(session, config.tenant_id, config.name)
            if row is None or row.auth_type != "oauth2":
                return None
            return open_oauth(vault, row.credentials)

        return StoredOAuth(config.url, record, save=save, reload=reload)

    # -- lifecycle -------------------------------------------------------------
    async def turn_ended(self, tenant_id: str, task_id: str) -> None:
        closed = await self.sessions.close_task(tenant_id, task_id)
        if closed:
            log.info("closed %d MCP session(s) of task %s", closed, task_id)

    async def task_removed(self, tenant_id: str, task_id: str) -> None:
        closed = await self.sessions.close_task(tenant_id, task_id, turn_end=False)
        if closed:
            log.info("task %s deleted: closed %d MCP session(s)", task_id, closed)

    async def sweep(self) -> None:
        closed = await self.sessions.sweep()
        for key in [k for k in self._auth if k not in self.sessions]:
            del self._auth[key]
        if closed:
            log.info("closed %d idle MCP session(s)", closed)

    async def aclose(self) -> None:
        await self.sessions.aclose()


class _Ready:
    """Streams already open, as the ``Transport`` the SDK's ``Client`` takes."""

    def __init__(self, streams: TransportStreams) -> None:
        self._streams = streams

    async def __aenter__(self) -> TransportStreams:
        return self._streams

    async def __aexit__(self, *exc: object) -> None:
        return None
