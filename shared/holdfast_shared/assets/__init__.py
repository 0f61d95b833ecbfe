"""The Asset Directory: a tenant's MCP servers, their stored credentials, and
their tools as the model sees them.

* :mod:`~holdfast_shared.assets.vault` — Fernet encryption at rest;
* :mod:`~holdfast_shared.assets.servers` — the rows, and a server with its
  secrets opened for a connection;
* :mod:`~holdfast_shared.assets.catalogue` — ``{server}__{tool}`` names,
  schemas and default permissions;
* :mod:`~holdfast_shared.assets.oauth` — what is kept of a server's OAuth 2.1
  authorization (the gateway's ``oauthflow`` runs it across the connect and
  callback requests; the tool-runner's ``connectors/oauthbearer`` is the
  refreshing bearer of a session).

The gateway registers servers and runs the authorization; the tool-runner
connects (the official ``mcp`` SDK is the client) and calls; the loop-worker
only reads which tools an agent's servers offer.
"""

from holdfast_shared.assets.catalogue import ServerTool, model_name, rule_for, server_tools
from holdfast_shared.assets.servers import (
    MAX_SERVER_NAME,
    NEEDS_AUTHORIZATION,
    READY,
    SERVER_NAME_PATTERN,
    ServerConfig,
    agent_server_tools,
    find_server,
    open_server,
    registered,
    tenant_servers,
)
from holdfast_shared.assets.vault import Vault, VaultError, vault_from_settings

__all__ = [
    "MAX_SERVER_NAME",
    "NEEDS_AUTHORIZATION",
    "READY",
    "SERVER_NAME_PATTERN",
    "ServerConfig",
    "ServerTool",
    "Vault",
    "VaultError",
    "agent_server_tools",
    "find_server",
    "model_name",
    "open_server",
    "registered",
    "rule_for",
    "server_tools",
    "tenant_servers",
    "vault_from_settings",
]
