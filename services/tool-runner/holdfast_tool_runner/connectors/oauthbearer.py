"""The tool-runner's half of OAuth 2.1 for MCP servers: the stored bearer of a session.

The gateway ran the authorization and stored an
:class:`~holdfast_shared.assets.oauth.OAuthRecord` in the server's
``credentials``; :class:`StoredOAuth` sends its access token on every request
of a session, refreshes it (with the SDK's refresh request) when it has
expired and once on a 401, and stores the refreshed tokens. Never interactive:
with no usable token it raises :class:`NeedsAuthorization`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import httpx2
from holdfast_shared.assets.oauth import OAuthRecord, client_metadata_for
from mcp.client.auth import OAuthClientProvider
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

# A token this close to its expiry (or a tenth of its lifetime, if shorter) is
# refreshed before use.
EXPIRY_MARGIN_SECONDS = 30.0


class NeedsAuthorization(Exception):
    """No usable token and none to be had without the user: connect again."""


Save = Callable[[OAuthRecord], Awaitable[None]]
Reload = Callable[[], Awaitable[OAuthRecord | None]]


class _RecordStorage:
    """The SDK provider's storage, kept in the record (and saved through ``save``)."""

    def __init__(self, owner: StoredOAuth) -> None:
        self.owner = owner

    async def get_tokens(self) -> OAuthToken | None:
        return self.owner.record.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        await self.owner.keep(tokens)

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.owner.record.client_info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        return None  # never registers: registration is begin()'s


class StoredOAuth(OAuthClientProvider):
    """The stored tokens on every request of a session; refreshed with the SDK's
    refresh request when expired, and once when the server answers 401.

    Never interactive: without a token it can use, it raises
    :class:`NeedsAuthorization` (and sets ``needs_authorization``), so the call
    fails with a clear error and the user connects the server again. ``reload``
    reads the record as stored now (another runner may have refreshed it);
    ``save`` stores the refreshed one.
    """

    def __init__(self, server_url: str, record: OAuthRecord, *, save: Save, reload: Reload) -> None:
        redirect = record.pending.redirect_uri if record.pending else "http://localhost/"
        if record.client_info and record.client_info.redirect_uris:
            redirect = str(record.client_info.redirect_uris[0])
        super().__init__(server_url, client_metadata_for(record, redirect), _RecordStorage(self))
        self.record = record
        self._save = save
        self._reload = reload
        self.needs_authorization = False
        self.refreshes = 0

    async def _initialize(self) -> None:
        context = self.context
        context.current_tokens = self.record.tokens
        context.token_expiry_time = self.record.expires_at
        context.client_info = self.record.client_info
        context.oauth_metadata = self.record.server_metadata
        context.protected_resource_metadata = self.record.resource_metadata
        self._initialized = True

    async def keep(self, tokens: OAuthToken) -> None:
        """Store refreshed ``tokens`` (the SDK carried the refresh token forward)."""
        self.record = self.record.model_copy(
            update={"tokens": tokens, "expires_at": self.context.token_expiry_time}
        )
        self.refreshes += 1
        await self._save(self.record)

    def _expired(self) -> bool:
        """Expired, or about to: within a tenth of its lifetime, at most the margin."""
        expiry = self.context.token_expiry_time
        if expiry is None:
            return False
        tokens = self.context.current_tokens
        lifetime = float(tokens.expires_in or 0) if tokens is not None else 0.0
        return time.time() > expiry - min(EXPIRY_MARGIN_SECONDS, lifetime / 10)

    async def _adopt_stored(self) -> None:
        """Take the stored record if it holds other tokens (refreshed elsewhere)."""
        stored = await self._reload()
        if stored is not None and stored.tokens != self.record.tokens:
            self.record = stored
            await self._initialize()

    def _refused(self) -> NeedsAuthorization:
        self.needs_authorization = True
        return NeedsAuthorization(
            "the server's authorization expired or was revoked and could not be "
            "refreshed; connect it again (GET /assets/servers/{name}/connect)"
        )

    async def _refresh_request(self) -> httpx2.Request:
        if not self.context.can_refresh_token():
            raise self._refused()
        return await self._refresh_token()

    async def _refreshed(self, response: httpx2.Response) -> None:
        if not await self._handle_refresh_response(response):
            raise self._refused()

    def _bearer(self) -> str | None:
        tokens = self.context.current_tokens
        return f"Bearer {tokens.access_token}" if tokens is not None else None

    async def _auth_flow(
        self, request: httpx2.Request
    ) -> AsyncGenerator[httpx2.Request, httpx2.Response]:
        async with self.context.lock:
            if not self._initialized:
                await self._initialize()
            if self.context.current_tokens is None or self._expired():
                await self._adopt_stored()
            if self.context.current_tokens is None:
                raise self._refused()
            if self._expired():
                await self._refreshed((yield await self._refresh_request()))
            self._add_auth_header(request)
            response = yield request
            if response.status_code != 401:
                return
            # Once: the token may have been revoked early, or the clock is off.
            sent = request.headers.get("Authorization")
            await self._adopt_stored()
            if self._bearer() == sent:  # nobody refreshed it meanwhile: we do
                await self._refreshed((yield await self._refresh_request()))
            self._add_auth_header(request)
            if (yield request).status_code == 401:
                self.needs_authorization = True
