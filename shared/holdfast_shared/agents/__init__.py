"""Agents: built-in definitions shipped as files, and a tenant's custom ones.

See :mod:`holdfast_shared.agents.definitions` for what an agent is and how
operators' settings override it, and :mod:`holdfast_shared.agents.store` for
how a name is resolved for a tenant.
"""

from holdfast_shared.agents.definitions import (
    DEFAULT_AGENT,
    AgentDefinition,
    AgentNotFound,
    builtin_agents,
    check_effect_key,
    check_permission_key,
    check_tool,
    effective_permissions,
    model_for,
    parse_agent_file,
    server_of_rule,
)
from holdfast_shared.agents.store import (
    custom_agents,
    find_agent,
    from_record,
    resolve_agent,
    unknown_servers,
    unknown_skills,
)

__all__ = [
    "DEFAULT_AGENT",
    "AgentDefinition",
    "AgentNotFound",
    "builtin_agents",
    "check_effect_key",
    "check_permission_key",
    "check_tool",
    "custom_agents",
    "effective_permissions",
    "find_agent",
    "from_record",
    "model_for",
    "parse_agent_file",
    "resolve_agent",
    "server_of_rule",
    "unknown_servers",
    "unknown_skills",
]
