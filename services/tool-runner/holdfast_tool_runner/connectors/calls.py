"""Calling a tenant's MCP servers: a tool call of a task, or a probe of a server.

:class:`Connectors` looks the server up for the job's tenant (PostgreSQL;
another tenant's server is simply not found), opens its credentials
(``HOLDFAST_ASSET_ENCRYPTION_KEY``), takes the task's session from
:class:`~holdfast_tool_runner.connectors.sessions.Sessions` or opens one, and
calls. Whatever goes wrong — the server is down, times out, dies mid-call,
wants authorization again — is an outcome, never an exception: the turn goes
on. A call the server may have received but never answered (its time ran out,
the connection broke after the request went) is an ``unknown`` outcome, which
the loop settles by the tool's effect class; the rest are errors. Outputs and
errors are redacted of the server's secrets (``outcomes.Redactor``).

A stdio server runs in the task's sandbox (its workspace, the agent's network
setting, the operator's ``HOLDFAST_ASSET_STDIO_PATHS`` read-only), its calls
holding the workspace as a sandboxed tool's do (restored if it hibernated, not
hibernated under them); an HTTP server is reached from the runner with its
credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

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
from holdfast_shared.jobs import (
    AssetProbeResult,
    ToolCallJob,
    ToolCallProgress,
    ToolOutcome,
    UnknownOutcome,
)
from holdfast_shared.outbound import DestinationNotAllowed, OutboundPolicy
from mcp import Client, MCPError
from mcp.client._transport import TransportStreams
from mcp.client.session import ClientRequestContext
from mcp.shared.dispatcher import ProgressFnT
from mcp_types import (
    CONNECTION_CLOSED,
    CreateMessageRequestParams,
    CreateMessageResult,
    ElicitRequestParams,
    ElicitResult,
    ErrorData,
    ListRootsResult,
    RequestParamsMeta,
    Root,
)
from sqlalchemy import update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_tool_runner.checkpoints import WorkspaceCheckpoints
from holdfast_tool_runner.connectors.elicitation import Elicitor, unanswerable
from holdfast_tool_runner.connectors.oauthbearer import NeedsAuthorization, StoredOAuth
from holdfast_tool_runner.connectors.outcomes import Redactor, call_outcome
from holdfast_tool_runner.connectors.progress import ProgressSink
from holdfast_tool_runner.connectors.sampling import Sampler, unservable
from holdfast_tool_runner.connectors.sessions import SessionKey, Sessions
from holdfast_tool_runner.connectors.transports import (
    IDEMPOTENCY_META,
    StderrTail,
    http_transport,
    resident_transport,
)
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
# Where the sandbox mounts the task's workspace: a stdio server's one root.
WORKSPACE_ROOT_URI = "file:///workspace"
# How long a stdio server's sandbox may live: well past any idle timeout.
_RESIDENT_SECONDS = 24 * 3600.0
# How long a call may use a server's row and credentials read before (_server).
_SERVER_CACHE_SECONDS = 2.0
_SERVER_CACHE_SIZE = 1024


class _Unavailable(Exception):
    """The server cannot be used now; the message is for the model (no secret
    but the server's own, which the outcome's redaction removes). ``stderr``: what
    a stdio server that failed to start wrote there last. ``refused``: the
    server's OAuth could not be refreshed (it needs connecting again)."""

    def __init__(self, message: str, stderr: str = "", *, refused: bool = False) -> None:
        super().__init__(message)
        self.stderr = stderr
        self.refused = refused

    def __str__(self) -> str:
        message = super().__str__()
        return f"{message}; its stderr ended: {self.stderr}" if self.stderr else message


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


def _cut_after_sending(exc: BaseException) -> bool:
    """Whether the request may have reached the server without its answer coming
    back. Only an answer (the server's own error), a refusal before anything was
    sent (no connection, a destination or authorization refused, an HTTP error
    status) says the call did not run; a connection cut any other way may have
    come after the server acted on it."""
    if isinstance(exc, BaseExceptionGroup):
        return any(_cut_after_sending(inner) for inner in exc.exceptions)
    if isinstance(exc, MCPError):
        return exc.error.code == CONNECTION_CLOSED
    return not isinstance(
        exc,
        NeedsAuthorization
        | DestinationNotAllowed
        | httpx2.ConnectError
        | ConnectionRefusedError
        | httpx2.InvalidURL
        | httpx2.UnsupportedProtocol
        | httpx2.HTTPStatusError,
    )


def _log_stderr(server: str, tenant_id: str, error: str, stderr: str) -> None:
    if stderr:
        log.warning(
            "MCP server %s of tenant %s: %s; its stderr ended:\n%s",
            *(server, tenant_id, error, stderr),
        )


def _progress_callback(sink: ProgressSink, redactor: Redactor) -> ProgressFnT:
    async def reported(progress: float, total: float | None, message: str | None) -> None:
        text = redactor.text(message) if message is not None else None
        await sink(ToolCallProgress(progress=progress, total=total, message=text))

    return reported


async def _workspace_roots(context: ClientRequestContext) -> ListRootsResult:
    """``roots/list`` of a stdio server: the workspace, as its sandbox mounts it."""
    root = Root.model_validate({"uri": WORKSPACE_ROOT_URI, "name": "workspace"})
    return ListRootsResult(roots=[root])


def _unknown(reason: str) -> ToolOutcome:
    return ToolOutcome(unknown=UnknownOutcome(reason=reason))


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
        stdio_idle_seconds: float | None = None,
        archiving: WorkspaceCheckpoints | None = None,
    ) -> None:
        self.db = sessions
        self.vault = vault
        self.workspaces = workspaces
        self.launchers = launchers
        self.stdio_paths = stdio_paths
        self.connect_timeout = connect_timeout
        self.outbound = outbound
        # Restores a stdio server's hibernated workspace before its call (None: no archives).
        self.archiving = archiving
        self.sessions = Sessions(idle_seconds=idle_seconds, local_idle_seconds=stdio_idle_seconds)
        # (tenant, server) → (until, row, opened config): see _server.
        self._opened: dict[tuple[str, str], tuple[float, AssetServer, ServerConfig]] = {}
        # Each open session's OAuth (none for other auth types).
        self._auth: dict[SessionKey, list[StoredOAuth]] = {}
        # Each stdio session's process and the tail of its stderr.
        self._residents: dict[SessionKey, Resident] = {}
        self._stderr: dict[SessionKey, StderrTail] = {}
        # Who asks the user a session's server's questions: its running call's turn.
        self._asking: dict[SessionKey, Elicitor] = {}
        # And who serves its sampling requests: the same turn's model.
        self._sampling: dict[SessionKey, Sampler] = {}

    # -- tool calls ------------------------------------------------------------
    async def call(
        self,
        job: ToolCallJob,
        progress: ProgressSink | None = None,
        elicit: Elicitor | None = None,
        sample: Sampler | None = None,
    ) -> ToolOutcome:
        """Run ``job`` (an MCP tool call) on its server; failures are outcomes.
        The server's progress reports go to ``progress``, redacted; its
        questions to the user (``elicitation/create``) to ``elicit``, its
        requests for a completion (``sampling/createMessage``) to ``sample``."""
        assert job.server is not None
        redactor = Redactor(())
        key = SessionKey(job.tenant_id, job.task_id, job.server)
        try:
            row, config = await self._server(job.tenant_id, job.server)
            redactor = Redactor(_secrets(config))
            async with self._workspace_held(config, job.tenant_id, job.task_id):
                return await self._call(job, key, row, config, redactor, progress, elicit, sample)
        except _Unavailable as exc:
            if exc.refused:
                await self._refused(job.tenant_id, job.server)
            return redactor.outcome(ToolOutcome(error=str(exc)))

    @contextlib.asynccontextmanager
    async def _workspace_held(
        self, config: ServerConfig, tenant_id: str, task_id: str
    ) -> AsyncIterator[None]:
        """For a stdio server's call (or probe), the task's workspace held as a
        sandboxed tool's call holds it (restored first if it hibernated, kept from
        hibernating while the call runs, its idle time counted from the call): the
        server runs in it. Between calls it may hibernate, which reaps the server;
        the next call starts it again."""
        if config.transport != "stdio" or self.archiving is None:
            yield
            return
        try:
            async with self.archiving.in_use(tenant_id, task_id):
                yield
        except WorkspaceError as exc:
            raise _Unavailable(f"workspace unavailable, the server did not start: {exc}") from None

    async def _call(
        self,
        job: ToolCallJob,
        key: SessionKey,
        row: AssetServer,
        config: ServerConfig,
        redactor: Redactor,
        progress: ProgressSink | None,
        elicit: Elicitor | None,
        sample: Sampler | None,
    ) -> ToolOutcome:
        assert job.server is not None
        tool = job.server_tool or job.tool
        client = await self._client(key, row, config, network=job.network)
        on_progress = _progress_callback(progress, redactor) if progress else None
        if elicit is not None:
            self._asking[key] = elicit
        if sample is not None:
            self._sampling[key] = sample
        try:
            async with asyncio.timeout(job.timeout_seconds):
                result = await client.call_tool(
                    tool,
                    job.input,
                    read_timeout_seconds=job.timeout_seconds,
                    progress_callback=on_progress,
                    meta=cast(RequestParamsMeta, {IDEMPOTENCY_META: job.idempotency_key}),
                )
        except TimeoutError:
            await self.sessions.discard(key)
            # Sent, and no answer: the server may have done it.
            return _unknown(
                f"the MCP server {job.server!r} did not answer within {job.timeout_seconds:g} s"
            )
        except Exception as exc:
            # Read before the discard: while it closes the session, the sweep may
            # forget the session's OAuth (it keeps only open sessions').
            refused = self._auth_refused(key)
            await self.sessions.discard(key)
            if _cut_after_sending(exc):
                return _unknown(f"MCP server {job.server!r}: {_describe(exc)}")
            raise _Unavailable(
                f"MCP server {job.server!r}: {_describe(exc)}", refused=refused
            ) from None
        finally:
            if self._asking.get(key) is elicit:
                self._asking.pop(key, None)
            if self._sampling.get(key) is sample:
                self._sampling.pop(key, None)
        self.sessions.touch(key)
        return redactor.outcome(call_outcome(result))

    # -- probes ----------------------------------------------------------------
    async def probe(self, tenant_id: str, server: str) -> AssetProbeResult:
        """Connect to the server, list its tools (every page) and close again."""
        redactor = Redactor(())
        stderr = StderrTail()
        try:
            row, config = await self._server(tenant_id, server, fresh=True)
            redactor = Redactor(_secrets(config))
            auth: list[StoredOAuth] = []
            async with (
                self._workspace_held(config, tenant_id, PROBE_TASK),
                asyncio.timeout(self.connect_timeout),
                self._open(
                    row, config, PROBE_TASK, network=False, auth=auth, stderr=stderr
                ) as client,
            ):
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
            error = str(exc.args[0])
        except TimeoutError:
            error = f"the server did not answer within {self.connect_timeout:g} s"
        except NeedsAuthorization as exc:
            return AssetProbeResult(error=str(exc), needs_authorization=True)
        except Exception as exc:
            needs = any(a.needs_authorization for a in auth)
            error, tail = redactor.text(_describe(exc)), redactor.text(await stderr.settled(1.0))
            _log_stderr(server, tenant_id, error, tail)
            return AssetProbeResult(error=error, stderr=tail or None, needs_authorization=needs)
        error, tail = redactor.text(error), redactor.text(await stderr.settled(1.0))
        _log_stderr(server, tenant_id, error, tail)
        return AssetProbeResult(error=error, stderr=tail or None)

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
            self._residents.pop(key, None)
            stderr = self._stderr[key] = StderrTail()

            def started(resident: Resident) -> None:
                self._residents[key] = resident

            return self._open(
                row,
                config,
                key.task_id,
                network=network,
                auth=auth,
                stderr=stderr,
                started=started,
                asking=key,
            )

        resident = self._residents.get(key)
        if resident is not None and not resident.alive:
            # Reaped (the workspace hibernated, the task paused) or exited since
            # its last call: a new process, rather than a call into a dead pipe.
            await self.sessions.discard(key)
        try:
            async with asyncio.timeout(self.connect_timeout):
                return await self.sessions.client(
                    key, _version(row), opener, local=config.transport == "stdio"
                )
        except TimeoutError:
            error = (
                f"cannot connect to the MCP server {config.name!r}: no answer within "
                f"{self.connect_timeout:g} s"
            )
        except (_Unavailable, NeedsAuthorization) as exc:
            error = f"MCP server {config.name!r}: {exc.args[0]}"
        except Exception as exc:
            error = f"cannot connect to the MCP server {config.name!r}: {_describe(exc)}"
        # Before any wait: the sweep forgets the OAuth of a session that never opened.
        refused = self._auth_refused(key)
        stderr = self._stderr.get(key)
        tail = await stderr.settled(1.0) if stderr is not None else ""
        tail = Redactor(_secrets(config)).text(tail)
        _log_stderr(config.name, config.tenant_id, error, tail)
        raise _Unavailable(error, tail, refused=refused)

    @contextlib.asynccontextmanager
    async def _open(
        self,
        row: AssetServer,
        config: ServerConfig,
        task_id: str,
        *,
        network: bool,
        auth: list[StoredOAuth],
        stderr: StderrTail | None = None,
        started: Callable[[Resident], None] | None = None,
        asking: SessionKey | None = None,
    ) -> AsyncIterator[Client]:
        """A connected, initialised client of the server (its transport closed
        after). A stdio server's stderr goes to ``stderr``, its process to
        ``started``; its questions to the user, to the running call of the
        session ``asking`` (a probe's are cancelled)."""

        async def asked(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
            # Offered to every server, so that it lists the tools that ask; the
            # question goes to whichever call of the session is running now.
            elicitor = self._asking.get(asking) if asking is not None else None
            return await (elicitor or unanswerable)(context, params)

        async def sampled(
            context: ClientRequestContext, params: CreateMessageRequestParams
        ) -> CreateMessageResult | ErrorData:
            sampler = self._sampling.get(asking) if asking is not None else None
            return await (sampler or unservable)(context, params)

        async with self._transport(
            config, task_id, network=network, auth=auth, stderr=stderr, started=started
        ) as streams:
            transport = _Ready(streams)
            # A stdio server's root is the task's workspace, where it runs; an
            # HTTP server is not on this machine, and is offered none.
            roots = _workspace_roots if config.transport == "stdio" else None
            async with Client(
                transport,
                read_timeout_seconds=self.connect_timeout,
                list_roots_callback=roots,
                elicitation_callback=asked,
                sampling_callback=sampled,
            ) as client:
                yield client

    @contextlib.asynccontextmanager
    async def _transport(
        self,
        config: ServerConfig,
        task_id: str,
        *,
        network: bool,
        auth: list[StoredOAuth],
        stderr: StderrTail | None,
        started: Callable[[Resident], None] | None,
    ) -> AsyncIterator[TransportStreams]:
        if config.transport == "stdio":
            resident = await self._start_stdio(config, task_id, network=network)
            if started is not None:
                started(resident)
            async with resident_transport(resident, stderr) as streams:
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

    def _auth_refused(self, key: SessionKey) -> bool:
        """Whether the OAuth of ``key``'s session found its tokens refused."""
        return any(a.needs_authorization for a in self._auth.get(key, ()))

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
    def kept_servers(self, tenant_id: str, task_id: str) -> list[object]:
        """A turn of the task ended normally: the processes of its stdio
        servers, which stay for its next turns (``reap_leftovers``' ``sparing``)."""
        kept = (self._residents.get(key) for key in self.sessions.local(tenant_id, task_id))
        return [resident.handle for resident in kept if resident is not None]

    async def task_stopped(self, tenant_id: str, task_id: str) -> None:
        """The task paused, parked or stopped: its stdio servers' sessions end
        (the reaper kills their processes)."""
        closed = await self.sessions.close_task(tenant_id, task_id)
        if closed:
            log.info("closed %d MCP session(s) of task %s", closed, task_id)

    async def task_removed(self, tenant_id: str, task_id: str) -> None:
        closed = await self.sessions.close_task(tenant_id, task_id, only_local=False)
        if closed:
            log.info("task %s deleted: closed %d MCP session(s)", task_id, closed)

    async def sweep(self) -> None:
        closed = await self.sessions.sweep()
        for key in [k for k in self._auth if k not in self.sessions]:
            del self._auth[key]
        for key in [k for k in self._residents if k not in self.sessions]:
            del self._residents[key]
        for key in [k for k in self._stderr if k not in self.sessions]:
            del self._stderr[key]
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
