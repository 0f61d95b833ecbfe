"""Finding agents: the built-ins (files) and a tenant's own (the ``agents`` table).

A built-in's name is never a custom agent's (the gateway refuses it), so a
name resolves to at most one agent: the built-in first. Another tenant's
agents are never found.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast_shared import skills
from holdfast_shared.agents.definitions import (
    DEFAULT_AGENT,
    AgentDefinition,
    AgentNotFound,
    builtin_agents,
)
from holdfast_shared.assets.servers import registered as registered_servers
from holdfast_shared.db.models import AgentRecord
from holdfast_shared.tools import Effect, Permission


def from_record(row: AgentRecord) -> AgentDefinition:
    """The definition a stored custom agent runs as."""
    return AgentDefinition(
        name=row.name,
        description=row.description,
        system_prompt=row.system_prompt,
        model=row.model,
        tools=tuple(row.tools),
        permissions=cast(dict[str, Permission], dict(row.permissions)),
        effects=cast(dict[str, Effect], dict(row.effects or {})),
        network=row.network,
        skills=tuple(row.skills),
        servers=tuple(row.servers),
        subagents=tuple(row.subagents or ()),
        builtin=False,
    )


async def find_agent(session: AsyncSession, tenant_id: str, name: str) -> AgentDefinition | None:
    """The agent ``name`` as the tenant sees it: a built-in, else its own, else None."""
    builtin = builtin_agents().get(name)
    if builtin is not None:
        return builtin
    row = await session.get(AgentRecord, (tenant_id, name))
    return None if row is None else from_record(row)


async def resolve_agent(
    sessions: async_sessionmaker[AsyncSession], tenant_id: str, name: str | None
) -> AgentDefinition:
    """The agent a turn runs as (``general`` when it names none); raises
    :class:`AgentNotFound`."""
    wanted = name or DEFAULT_AGENT
    builtin = builtin_agents().get(wanted)
    if builtin is not None:
        return builtin  # no database round trip for the common case
    async with sessions() as session:
        found = await find_agent(session, tenant_id, wanted)
    if found is None:
        raise AgentNotFound(wanted)
    return found


async def custom_agents(session: AsyncSession, tenant_id: str) -> list[AgentRecord]:
    """The tenant's own agents, by name."""
    rows = await session.scalars(
        select(AgentRecord).where(AgentRecord.tenant_id == tenant_id).order_by(AgentRecord.name)
    )
    return list(rows)


async def unknown_skills(session: AsyncSession, tenant_id: str, names: Iterable[str]) -> list[str]:
    """The names among ``names`` that are no skill the tenant can give an agent
    (built-in or its own, ``holdfast_shared.skills``), in order, once each."""
    return await skills.unknown_skills(session, tenant_id, names)


async def unknown_servers(session: AsyncSession, tenant_id: str, names: Iterable[str]) -> list[str]:
    """The names among ``names`` that are no Asset Directory server of the
    tenant (``asset_servers``; another tenant's are unknown), in order, once each."""
    wanted = list(dict.fromkeys(names))
    found = await registered_servers(session, tenant_id, wanted)
    return [name for name in wanted if name not in found]
