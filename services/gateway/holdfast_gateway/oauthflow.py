"""The gateway's half of OAuth 2.1 with PKCE for MCP servers, as the MCP
authorization spec describes it, split across requests the way a server-side
engine needs it.

The SDK's :class:`~mcp.client.auth.OAuthClientProvider` runs the whole flow inside
one HTTP request of one process, waiting for the browser in between. The engine
cannot wait: ``GET /assets/servers/{name}/connect`` answers the authorization URL
at once, and the browser comes back to ``GET /assets/oauth/callback`` later,
perhaps on another gateway. So the flow is three steps over a stored
:class:`~holdfast_shared.assets.oauth.OAuthRecord` (sealed in the server's
``credentials``), each built from
the SDK's pieces (its discovery URL builders and response handlers, its
registration request, :class:`PKCEParameters`, its models):

* :func:`begin` — discover the protected resource metadata from the MCP server
  (RFC 9728: the ``resource_metadata`` of its ``WWW-Authenticate``, else the
  well-known URLs), then the authorization server's metadata (RFC 8414 / OIDC),
  register a client dynamically (RFC 7591) unless one was given, and make the
  authorization URL: S256 code challenge, ``state``, ``resource`` (RFC 8707),
  scope. The verifier and state wait in the record, ``PENDING_SECONDS`` at most.
* :func:`complete` — the callback: check ``state``, exchange the code with the
  verifier, keep the tokens and their expiry.
* ``StoredOAuth`` (the tool-runner's ``connectors/oauthbearer.py``) — on every
  request of a session: the stored access token; refreshed when it has expired,
  and once on a 401; never interactive.

The HTTP client is the caller's: one built on the outbound policy
(``holdfast_shared.outbound``), so every endpoint a server's metadata names is
judged as it is dialled; a refusal comes out as
:class:`~holdfast_shared.outbound.DestinationNotAllowed` naming the metadata
field that led there. What a remote server answered is never in an error's
message (it reaches the tenant): only its status; the body is logged at debug.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any
from urllib.parse import urlencode, urljoin, urlparse

import httpx2
from holdfast_shared.assets.oauth import OAuthRecord, PendingAuthorization, client_metadata_for
from holdfast_shared.outbound import DestinationNotAllowed
from mcp.client.auth import OAuthFlowError, PKCEParameters
from mcp.client.auth.exceptions import OAuthRegistrationError, OAuthTokenError
from mcp.client.auth.oauth2 import OAuthContext, check_registration_usable
from mcp.client.auth.utils import (
    build_oauth_authorization_server_metadata_discovery_urls,
    build_protected_resource_metadata_discovery_urls,
    create_client_registration_request,
    create_oauth_metadata_request,
    extract_resource_metadata_from_www_auth,
    extract_scope_from_www_auth,
    get_client_metadata_scopes,
    handle_auth_metadata_response,
    handle_protected_resource_response,
    handle_registration_response,
    handle_token_response_scopes,
    validate_metadata_issuer,
)
from mcp.shared.auth import (
    OAuthClientInformationFull,
    OAuthMetadata,
    OAuthToken,
    ProtectedResourceMetadata,
)
from mcp.shared.auth_utils import calculate_token_expiry
from pydantic import AnyUrl

log = logging.getLogger(__name__)

# How long an authorization URL stays good for its callback.
PENDING_SECONDS = 600.0


class AuthorizationFailed(Exception):
    """The authorization could not complete; the message says why (never a secret)."""


class _NoStorage:
    """The SDK context wants a storage; the steps here keep the record themselves."""

    async def get_tokens(self) -> OAuthToken | None:
        return None

    async def set_tokens(self, tokens: OAuthToken) -> None:
        return None

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return None

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        return None


def _context(server_url: str, record: OAuthRecord, redirect_uri: str) -> OAuthContext:
    """The SDK's flow context over ``record``: resource URL, token-endpoint auth."""
    context = OAuthContext(
        server_url=server_url,
        client_metadata=client_metadata_for(record, redirect_uri),
        storage=_NoStorage(),
        redirect_handler=None,
        callback_handler=None,
    )
    context.protected_resource_metadata = record.resource_metadata
    context.oauth_metadata = record.server_metadata
    context.client_info = record.client_info
    context.current_tokens = record.tokens
    context.token_expiry_time = record.expires_at
    return context


def _origin(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.scheme}://{parsed.netloc}"


class _Stage:
    """Which URL of the flow is being fetched: the field a refusal names."""

    def __init__(self) -> None:
        self.loc: tuple[str, ...] = ("url",)


async def _discover(
    http: httpx2.AsyncClient, server_url: str, stage: _Stage
) -> tuple[ProtectedResourceMetadata | None, OAuthMetadata | None, str | None]:
    """The server's protected resource metadata, its authorization server's
    metadata, and the scope its challenge asks for."""
    # An unauthenticated request: a protected server answers 401 naming its metadata.
    stage.loc = ("url",)
    probe = await http.post(
        server_url,
        json={"jsonrpc": "2.0", "id": 0, "method": "ping"},
        headers={"Accept": "application/json, text/event-stream"},
    )
    await probe.aread()
    challenge_url = extract_resource_metadata_from_www_auth(probe)
    challenge_scope = extract_scope_from_www_auth(probe) if probe.status_code == 401 else None
    resource: ProtectedResourceMetadata | None = None
    stage.loc = ("www-authenticate", "resource_metadata") if challenge_url else ("url",)
    for url in build_protected_resource_metadata_discovery_urls(challenge_url, server_url):
        resource = await handle_protected_resource_response(
            await http.send(create_oauth_metadata_request(url))
        )
        if resource is not None:
            break
    issuer = str(resource.authorization_servers[0]) if resource is not None else None
    metadata: OAuthMetadata | None = None
    stage.loc = ("resource_metadata", "authorization_servers") if issuer else ("url",)
    for url in build_oauth_authorization_server_metadata_discovery_urls(issuer, server_url):
        ok, found = await handle_auth_metadata_response(
            await http.send(create_oauth_metadata_request(url))
        )
        if not ok:
            break
        if found is not None:
            validate_metadata_issuer(found, issuer or str(found.issuer))
            metadata = found
            break
    return resource, metadata, challenge_scope


async def _register(
    http: httpx2.AsyncClient, registration: httpx2.Request, name: str
) -> OAuthClientInformationFull:
    """Dynamic client registration; a refusal says its status, never its body."""
    response = await http.send(registration)
    if response.status_code not in (200, 201):
        body = (await response.aread())[:2048]
        log.debug(
            "server %s: client registration answered %d: %r", name, response.status_code, body
        )
        raise AuthorizationFailed(
            f"the authorization server answered {response.status_code} to client registration"
        )
    try:
        client = await handle_registration_response(response)
    except OAuthRegistrationError as exc:  # its message holds the body
        log.debug("server %s: client registration answer: %s", name, exc)
        raise AuthorizationFailed(
            "the authorization server's answer to client registration is invalid"
        ) from None
    check_registration_usable(client)
    return client


async def begin(
    http: httpx2.AsyncClient,
    server_url: str,
    record: OAuthRecord,
    redirect_uri: str,
    *,
    name: str = "?",
) -> tuple[str, OAuthRecord]:
    """The authorization URL to send the user to, and the record to store until
    the callback. Raises :class:`AuthorizationFailed` naming what went wrong
    (``name``, the server's, is for the logs), and
    :class:`~holdfast_shared.outbound.DestinationNotAllowed` naming the field
    whose URL the outbound policy refused."""
    stage = _Stage()
    try:
        resource, metadata, challenged = await _discover(http, server_url, stage)
        client_metadata = client_metadata_for(record, redirect_uri)
        scope = record.scope or get_client_metadata_scopes(
            challenged, resource, metadata, client_metadata.grant_types
        )
        client_metadata.scope = scope
        if record.client_id:
            client = OAuthClientInformationFull(
                client_id=record.client_id,
                client_secret=record.client_secret,
                redirect_uris=[AnyUrl(redirect_uri)],
                token_endpoint_auth_method=client_metadata.token_endpoint_auth_method,
            )
        elif record.client_info is not None and redirect_uri in [
            str(uri) for uri in record.client_info.redirect_uris or ()
        ]:
            client = record.client_info  # registered before, for this same redirect
        else:
            registration = create_client_registration_request(
                metadata, client_metadata, _origin(server_url)
            )
            stage.loc = ("authorization_server_metadata", "registration_endpoint")
            client = await _register(http, registration, name)
    except DestinationNotAllowed as exc:
        raise exc.at(stage.loc) from None
    except OAuthRegistrationError as exc:
        log.debug("server %s: client registration: %s", name, exc)
        raise AuthorizationFailed("the registered client cannot be used") from None
    except OAuthFlowError as exc:  # its message may hold what a server answered
        log.debug("server %s: OAuth discovery: %s", name, exc)
        raise AuthorizationFailed(
            "the server's OAuth metadata could not be discovered or is invalid"
        ) from None
    except httpx2.HTTPError as exc:
        raise AuthorizationFailed(
            f"cannot reach the server or its authorization server: {type(exc).__name__}"
        ) from None
    pkce = PKCEParameters.generate()
    state = secrets.token_urlsafe(32)
    found = record.model_copy(
        update={
            "resource_metadata": resource,
            "server_metadata": metadata,
            "client_info": client,
            "scope": scope,
            "pending": PendingAuthorization(
                state=state,
                code_verifier=pkce.code_verifier,
                redirect_uri=redirect_uri,
                expires_at=time.time() + PENDING_SECONDS,
            ),
        }
    )
    context = _context(server_url, found, redirect_uri)
    endpoint = (
        str(metadata.authorization_endpoint)
        if metadata is not None
        else urljoin(_origin(server_url), "/authorize")
    )
    params = {
        "response_type": "code",
        "client_id": client.client_id,
        "redirect_uri": redirect_uri,
        "state": state,
        "code_challenge": pkce.code_challenge,
        "code_challenge_method": "S256",
        # RFC 8707: the MCP spec has clients name the server the token is for.
        "resource": context.get_resource_url(),
    }
    if scope:
        params["scope"] = scope
    return f"{endpoint}?{urlencode(params)}", found


async def complete(
    http: httpx2.AsyncClient, server_url: str, record: OAuthRecord, *, code: str, state: str
) -> OAuthRecord:
    """The record with the tokens the code buys; :class:`AuthorizationFailed` if it
    buys none (wrong or expired state, a refused code);
    :class:`~holdfast_shared.outbound.DestinationNotAllowed` (``token_endpoint``)
    if the outbound policy refuses the token endpoint."""
    pending = record.pending
    if pending is None or not secrets.compare_digest(pending.state, state):
        raise AuthorizationFailed("no authorization of this server is waiting for that state")
    if time.time() > pending.expires_at:
        raise AuthorizationFailed("the authorization expired; connect again")
    context = _context(server_url, record, pending.redirect_uri)
    if record.client_info is None:
        raise AuthorizationFailed("no client registered for the authorization")
    endpoint = (
        str(record.server_metadata.token_endpoint)
        if record.server_metadata is not None
        else urljoin(_origin(server_url), "/token")
    )
    data: dict[str, str] = {
        "grant_type": "authorization_code",
        "code": code,
        "redirect_uri": pending.redirect_uri,
        "client_id": record.client_info.client_id,
        "code_verifier": pending.code_verifier,
        "resource": context.get_resource_url(),
    }
    try:
        data, headers = context.prepare_token_auth(
            data, {"Content-Type": "application/x-www-form-urlencoded"}
        )
        try:
            response = await http.post(endpoint, data=data, headers=headers)
        except DestinationNotAllowed as exc:
            raise exc.at(("authorization_server_metadata", "token_endpoint")) from None
        if response.status_code not in (200, 201):
            raise AuthorizationFailed(
                f"the authorization server refused the code (HTTP {response.status_code}"
                f"{_oauth_error(response)})"
            )
        tokens = await handle_token_response_scopes(response)
    except OAuthTokenError:
        raise AuthorizationFailed("the authorization server's token answer is invalid") from None
    except httpx2.HTTPError as exc:
        raise AuthorizationFailed(
            f"cannot reach the authorization server: {type(exc).__name__}"
        ) from None
    if tokens.scope is None:
        tokens.scope = record.scope
    return record.model_copy(
        update={
            "tokens": tokens,
            "expires_at": calculate_token_expiry(tokens.expires_in),
            "pending": None,
        }
    )


def _oauth_error(response: httpx2.Response) -> str:
    """The OAuth ``error`` code of a refusal, if it names one (never its other fields)."""
    try:
        body: Any = response.json()
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    return f": {error}" if isinstance(error, str) and error.isascii() and len(error) < 64 else ""
