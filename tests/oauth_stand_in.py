"""A small OAuth 2.1 authorization server, and an MCP server (the Python SDK's
``MCPServer``) that takes only its tokens — each a real uvicorn server in a thread.

The authorization server does what the MCP authorization spec asks of one, and
checks what a client must do: metadata (RFC 8414), dynamic client registration
(RFC 7591), the authorization code grant with PKCE (S256 only; the verifier is
checked), the ``resource`` indicator (RFC 8707), refresh tokens that rotate
(the old one stops working), and access tokens that expire after
``access_seconds``. It approves every authorization at once, the way a user
clicking "allow" would, and counts the grants it made, so tests can see a
refresh happen. :meth:`revoke_access` makes every access token fail before its
time (a 401 the client must answer with one refresh).
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import uvicorn
from mcp.server.auth.provider import AccessToken
from mcp.server.auth.settings import AuthSettings
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Thread:
    """A uvicorn server on 127.0.0.1 in a daemon thread."""

    def __init__(self, app: Any, port: int) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the stand-in server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@dataclass
class _Code:
    client_id: str
    redirect_uri: str
    challenge: str
    resource: str | None
    scope: str | None


@dataclass
class AuthorizationServer:
    access_seconds: int = 3
    port: int = field(default_factory=_free_port)
    clients: dict[str, dict[str, Any]] = field(default_factory=dict)
    codes: dict[str, _Code] = field(default_factory=dict)
    access: dict[str, tuple[float, str | None]] = field(default_factory=dict)
    refresh: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    grants: Counter[str] = field(default_factory=Counter)
    issued: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/.well-known/oauth-authorization-server", self._metadata),
                Route("/register", self._register, methods=["POST"]),
                Route("/authorize", self._authorize),
                Route("/token", self._token, methods=["POST"]),
            ]
        )

    # -- what resource servers ask ---------------------------------------------------
    def check(self, token: str) -> tuple[float, str | None] | None:
        found = self.access.get(token)
        if found is None or time.time() > found[0]:
            return None
        return found

    def revoke_access(self) -> None:
        """Every access token stops working now (refresh tokens still do)."""
        self.access.clear()

    def revoke_everything(self) -> None:
        self.access.clear()
        self.refresh.clear()

    # -- endpoints ---------------------------------------------------------------------
    async def _metadata(self, _: Request) -> Response:
        return JSONResponse(
            {
                "issuer": self.issuer,
                "authorization_endpoint": f"{self.issuer}/authorize",
                "token_endpoint": f"{self.issuer}/token",
                "registration_endpoint": f"{self.issuer}/register",
                "response_types_supported": ["code"],
                "grant_types_supported": ["authorization_code", "refresh_token"],
                "code_challenge_methods_supported": ["S256"],
                "token_endpoint_auth_methods_supported": ["none"],
                "scopes_supported": ["notes"],
            }
        )

    async def _register(self, request: Request) -> Response:
        body = await request.json()
        if not body.get("redirect_uris"):
            return JSONResponse({"error": "invalid_redirect_uri"}, status_code=400)
        client_id = f"client-{secrets.token_hex(6)}"
        self.clients[client_id] = body
        return JSONResponse(
            {
                **body,
                "client_id": client_id,
                "client_id_issued_at": int(time.time()),
                "token_endpoint_auth_method": "none",
            },
            status_code=201,
        )

    def _refuse(self, why: str, status: int = 400) -> Response:
        self.refused.append(why)
        return JSONResponse({"error": why}, status_code=status)

    async def _authorize(self, request: Request) -> Response:
        q = request.query_params
        client = self.clients.get(q.get("client_id", ""))
        if client is None:
            return self._refuse("unauthorized_client")
        redirect_uri = q.get("redirect_uri", "")
        if redirect_uri not in client["redirect_uris"]:
            return self._refuse("invalid_redirect_uri")
        if q.get("response_type") != "code":
            return self._refuse("unsupported_response_type")
        if q.get("code_challenge_method") != "S256" or len(q.get("code_challenge", "")) < 43:
            return self._refuse("invalid_request: PKCE S256 required")
        if not q.get("state"):
            return self._refuse("invalid_request: no state")
        code = secrets.token_urlsafe(24)
        self.codes[code] = _Code(
            q["client_id"], redirect_uri, q["code_challenge"], q.get("resource"), q.get("scope")
        )
        # The user says yes at once.
        location = f"{redirect_uri}?{urlencode({'code': code, 'state': q['state']})}"
        return RedirectResponse(location, status_code=302)

    def _tokens(self, client_id: str, resource: str | None, scope: str | None) -> Response:
        access = f"at-{secrets.token_urlsafe(24)}"
        refresh = f"rt-{secrets.token_urlsafe(24)}"
        self.access[access] = (time.time() + self.access_seconds, resource)
        self.refresh[refresh] = (client_id, resource)
        self.issued += [access, refresh]
        return JSONResponse(
            {
                "access_token": access,
                "token_type": "Bearer",
                "expires_in": self.access_seconds,
                "refresh_token": refresh,
                "scope": scope or "notes",
            }
        )

    async def _token(self, request: Request) -> Response:
        form = await request.form()
        grant = str(form.get("grant_type", ""))
        if grant == "authorization_code":
            code = self.codes.pop(str(form.get("code", "")), None)
            if code is None:
                return self._refuse("invalid_grant")
            if (
                form.get("client_id") != code.client_id
                or form.get("redirect_uri") != code.redirect_uri
            ):
                return self._refuse("invalid_grant: client or redirect")
            verifier = str(form.get("code_verifier", ""))
            digest = hashlib.sha256(verifier.encode()).digest()
            if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != code.challenge:
                return self._refuse("invalid_grant: PKCE verifier")
            if form.get("resource") != code.resource:
                return self._refuse("invalid_target")
            self.grants["authorization_code"] += 1
            return self._tokens(code.client_id, code.resource, code.scope)
        if grant == "refresh_token":
            # Rotation: a refresh token works once.
            found = self.refresh.pop(str(form.get("refresh_token", "")), None)
            if found is None or found[0] != form.get("client_id"):
                return self._refuse("invalid_grant: refresh token")
            self.grants["refresh_token"] += 1
            return self._tokens(found[0], found[1], None)
        return self._refuse("unsupported_grant_type")


class _Verifier:
    def __init__(self, server: AuthorizationServer) -> None:
        self.server = server

    async def verify_token(self, token: str) -> AccessToken | None:
        found = self.server.check(token)
        if found is None:
            return None
        return AccessToken(
            token=token,
            client_id="any",
            scopes=["notes"],
            expires_at=int(found[0]),
            resource=found[1],
        )


class ProtectedNotes:
    """The authorization server and a notes MCP server behind it, both running."""

    def __init__(self, *, access_seconds: int = 3) -> None:
        self.authorization = AuthorizationServer(access_seconds=access_seconds)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.notes: list[str] = []
        mcp = MCPServer(
            "notes",
            token_verifier=_Verifier(self.authorization),
            auth=AuthSettings(
                issuer_url=self.authorization.issuer,  # type: ignore[arg-type]
                resource_server_url=self.url,  # type: ignore[arg-type]
                required_scopes=["notes"],
                validate_token_resource=True,
            ),
        )

        @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
        def count_notes() -> str:
            """How many notes there are."""
            return f"{len(self.notes)} note(s)"

        @mcp.tool(annotations=ToolAnnotations(read_only_hint=True))
        async def pause(seconds: float) -> str:
            """Wait, then answer."""
            import asyncio

            await asyncio.sleep(seconds)
            return f"paused {seconds:g} s"

        @mcp.tool()
        def add_note(text: str) -> str:
            """Add a note."""
            self.notes.append(text)
            return f"noted: {text}"

        self._servers = [
            _Thread(self.authorization.app(), self.authorization.port),
            _Thread(mcp.streamable_http_app(), self.port),
        ]

    def start(self) -> ProtectedNotes:
        for server in self._servers:
            server.start()
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.stop()
