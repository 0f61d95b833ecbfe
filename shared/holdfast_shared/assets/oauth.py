"""What the engine keeps of one MCP server's OAuth 2.1 authorization, sealed at rest.

The gateway runs the authorization (``holdfast_gateway.oauthflow``: discover,
register, the authorization URL, the callback's code exchange) and stores an
:class:`OAuthRecord` in the server's ``credentials``; the tool-runner reads it
on every request of a session and stores the refreshed tokens
(``holdfast_tool_runner.connectors.oauthbearer``). Both build the client
metadata they send the same way (:func:`client_metadata_for`), so a client
registered by one is the client the other refreshes with.
"""

from __future__ import annotations

from mcp.shared.auth import (
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthMetadata,
    OAuthToken,
    ProtectedResourceMetadata,
)
from pydantic import AnyUrl, BaseModel

CLIENT_NAME = "Holdfast"


class PendingAuthorization(BaseModel):
    """An authorization URL handed out and not completed yet."""

    state: str
    code_verifier: str
    redirect_uri: str
    expires_at: float


class OAuthRecord(BaseModel):
    """Everything OAuth about one server, sealed at rest.

    ``client_id``/``client_secret``/``scope``: what the tenant registered (a
    pre-registered client; else dynamic registration). The rest is found or
    obtained: the discovered metadata, the client, the tokens and when the
    access token expires (epoch seconds), a pending authorization.
    """

    client_id: str | None = None
    client_secret: str | None = None
    scope: str | None = None
    resource_metadata: ProtectedResourceMetadata | None = None
    server_metadata: OAuthMetadata | None = None
    client_info: OAuthClientInformationFull | None = None
    tokens: OAuthToken | None = None
    expires_at: float | None = None
    pending: PendingAuthorization | None = None

    @property
    def authorized(self) -> bool:
        return self.tokens is not None


def client_metadata_for(record: OAuthRecord, redirect_uri: str) -> OAuthClientMetadata:
    return OAuthClientMetadata(
        client_name=CLIENT_NAME,
        redirect_uris=[AnyUrl(redirect_uri)],
        grant_types=["authorization_code", "refresh_token"],
        response_types=["code"],
        token_endpoint_auth_method="client_secret_post" if record.client_secret else "none",
        scope=record.scope,
    )
