"""The Asset Directory's servers: a tenant's rows, and a server as a client connects to it.

A row (``AssetServer``) keeps its secrets sealed (``vault.py``); :func:`open_server`
opens them into a :class:`ServerConfig` where a connection is made — the
tool-runner, the gateway completing an authorization — and nowhere else. A
config's ``repr`` shows no secret, so a log line or a traceback naming one
leaks nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_shared.assets.catalogue import ServerTool, server_tools
from holdfast_shared.assets.oauth import OAuthRecord
from holdfast_shared.assets.vault import Vault
from holdfast_shared.db.models import AssetServer

Transport = Literal["streamable-http", "stdio"]
AuthType = Literal["none", "bearer", "oauth2"]

# A server's name: letters and digits, single - or _ between them (never "__",
# which separates the server from the tool in the names the model sees).
SERVER_NAME_PATTERN = r"^[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)*$"
MAX_SERVER_NAME = 48

READY = "ready"
NEEDS_AUTHORIZATION = "needs_authorization"


class ServerConfig(BaseModel):
    """One server with its secrets opened: what a connection needs."""

    model_config = ConfigDict(frozen=True)

    tenant_id: str
    name: str
    transport: Transport
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, SecretStr] = Field(default_factory=dict)
    auth_type: AuthType = "none"
    bearer: SecretStr | None = None
    oauth: OAuthRecord | None = Field(default=None, repr=False)

    def plain_env(self) -> dict[str, str]:
        return {key: value.get_secret_value() for key, value in self.env.items()}


def seal_credentials(vault: Vault, auth_type: AuthType, value: Any) -> str | None:
    """The ``credentials`` column for ``value``: the bearer token (a string) or an
    :class:`OAuthRecord`; None for ``none``."""
    if auth_type == "bearer":
        return vault.seal({"type": "bearer", "token": value})
    if auth_type == "oauth2":
        assert isinstance(value, OAuthRecord)
        return vault.seal({"type": "oauth2", "record": value.model_dump(mode="json")})
    return None


def open_oauth(vault: Vault, credentials: str | None) -> OAuthRecord:
    """The OAuth record sealed in a row's ``credentials`` (an empty one if none)."""
    if credentials is None:
        return OAuthRecord()
    opened = vault.open(credentials)
    return OAuthRecord.model_validate(opened.get("record") or {})


def open_server(row: AssetServer, vault: Vault) -> ServerConfig:
    """``row`` with its env and credentials opened (VaultError if they cannot be)."""
    env = vault.open(row.env) if row.env else {}
    bearer = None
    oauth = None
    if row.credentials is not None:
        opened = vault.open(row.credentials)
        if opened.get("type") == "bearer":
            bearer = SecretStr(str(opened.get("token") or ""))
        elif opened.get("type") == "oauth2":
            oauth = OAuthRecord.model_validate(opened.get("record") or {})
    return ServerConfig(
        tenant_id=row.tenant_id,
        name=row.name,
        transport=row.transport,
        url=row.url,
        command=row.command,
        args=tuple(row.args),
        env={key: SecretStr(str(value)) for key, value in env.items()},
        auth_type=row.auth_type,
        bearer=bearer,
        oauth=oauth,
    )


async def find_server(session: AsyncSession, tenant_id: str, name: str) -> AssetServer | None:
    """The tenant's server ``name``; None for a name it has not (also another tenant's)."""
    return await session.get(AssetServer, (tenant_id, name))


async def tenant_servers(session: AsyncSession, tenant_id: str) -> list[AssetServer]:
    """The tenant's servers, by name."""
    rows = await session.scalars(
        select(AssetServer).where(AssetServer.tenant_id == tenant_id).order_by(AssetServer.name)
    )
    return list(rows)


async def registered(session: AsyncSession, tenant_id: str, names: Iterable[str]) -> set[str]:
    """Which of ``names`` are servers of the tenant."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return set()
    found = await session.scalars(
        select(AssetServer.name).where(
            AssetServer.tenant_id == tenant_id, AssetServer.name.in_(wanted)
        )
    )
    return set(found)


async def agent_server_tools(
    session: AsyncSession, tenant_id: str, servers: Iterable[str]
) -> list[ServerTool]:
    """The tools of the tenant's ``servers`` (those it still has), server by server
    in the agent's order; a server waiting for authorization offers none."""
    wanted = list(dict.fromkeys(servers))
    if not wanted:
        return []
    rows = await session.execute(
        select(AssetServer.name, AssetServer.tools, AssetServer.status, AssetServer.effects).where(
            AssetServer.tenant_id == tenant_id, AssetServer.name.in_(wanted)
        )
    )
    by_name = {name: (tools, status, effects) for name, tools, status, effects in rows}
    found: list[ServerTool] = []
    for name in wanted:
        if name in by_name and by_name[name][1] == READY:
            tools, _status, effects = by_name[name]
            found.extend(server_tools(name, tools, effects))
    return found
