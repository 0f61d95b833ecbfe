"""``/agents``: the built-in agents and the tenant's own.

``GET /agents`` lists both (each marked ``builtin``; without the system
prompts, which ``GET /agents/{name}`` gives). ``POST /agents`` creates a
custom agent (201), ``PUT /agents/{name}`` replaces one, ``DELETE`` removes
it (204). A custom agent never takes a built-in's name (409
``AGENT_EXISTS``), and built-ins cannot be replaced or deleted (409
``AGENT_BUILTIN``). Another tenant's agents answer 404 ``AGENT_NOT_FOUND``,
as names that do not exist do.

Validation answers 422 ``INVALID_REQUEST`` naming the field (``details.errors``
``loc``) and the value: an unknown tool, a permission for one, a malformed
model; a skill or server the tenant does not have (``type``
``unknown_skill`` / ``unknown_server``: those depend on what the tenant
stored, so only the store can say). A turn that runs as an agent resolves it
when it starts (loop-worker ``turn/start.py``); a change applies to turns that
start after it.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Body, Path, Response
from holdfast_shared.agents import (
    DEFAULT_AGENT,
    AgentDefinition,
    builtin_agents,
    check_effect_key,
    check_permission_key,
    check_tool,
    custom_agents,
    effective_permissions,
    find_agent,
    from_record,
    server_of_rule,
    unknown_servers,
    unknown_skills,
)
from holdfast_shared.agents.definitions import SERVER_RULE_PATTERN
from holdfast_shared.assets import ServerTool, agent_server_tools
from holdfast_shared.content import Text
from holdfast_shared.db.models import AgentRecord
from holdfast_shared.errors import ErrorCode
from holdfast_shared.ids import ID_PATTERN
from holdfast_shared.modelspec import MODEL_SPEC_PATTERN, parse_model_spec
from holdfast_shared.tools import (
    BUILTIN_BY_NAME,
    DEFAULT_EFFECTS,
    DELEGATE,
    EFFECTS,
    SKILL,
    Effect,
    Permission,
)
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from sqlalchemy import delete, func, update
from sqlalchemy.dialects.postgresql import insert

from holdfast_gateway import errors
from holdfast_gateway.deps import JsonBody, StateDep, TenantDep, agent_not_found
from holdfast_gateway.errors import ApiError

router = APIRouter(tags=["agents"])

MAX_SYSTEM_PROMPT_CHARS = 100_000
MAX_DESCRIPTION_CHARS = 2_000
MAX_ITEMS = 64

_TOOL_NAMES = list(BUILTIN_BY_NAME)
_MODEL_SPEC = re.compile(MODEL_SPEC_PATTERN)


def _model_spec(value: str) -> str:
    parse_model_spec(value)  # ValueError naming the provider → 422
    if not _MODEL_SPEC.fullmatch(value):
        raise ValueError("a model is provider[:model], in ASCII without spaces")
    return value


ToolName = Annotated[
    str, AfterValidator(check_tool), Field(json_schema_extra={"enum": _TOOL_NAMES})
]
"""A tool of the catalogue; another name is a 422 naming it."""

Name = Annotated[str, Field(pattern=ID_PATTERN)]

PermissionKey = Annotated[str, AfterValidator(check_permission_key)]
"""A tool of the catalogue, or ``{server}__{tool}`` / ``{server}__*`` of one of the
agent's servers (checked against ``servers`` with the store: ``_check_references``)."""

EffectKey = Annotated[str, AfterValidator(check_effect_key)]
"""What a permission rule may name (but the loop's own tools), or ``bash:<glob>``."""
_EFFECT_SCHEMA = {"enum": list(EFFECTS)}


class AgentSpec(BaseModel):
    """What an agent is made of: ``PUT /agents/{name}``'s body (and ``POST``'s, with ``name``)."""

    model_config = ConfigDict(extra="forbid")

    description: Annotated[Text, Field(min_length=1, max_length=MAX_DESCRIPTION_CHARS)]
    system_prompt: Annotated[
        Text,
        Field(
            min_length=1,
            max_length=MAX_SYSTEM_PROMPT_CHARS,
            description="the agent's system prompt: the first section of the model's context",
        ),
    ]
    model: (
        Annotated[
            str,
            AfterValidator(_model_spec),
            Field(
                min_length=1,
                max_length=200,
                description="the preferred provider[:model]: used when a loop-worker serves "
                "the provider, else the engine's default; a request's model wins",
                json_schema_extra={"pattern": MODEL_SPEC_PATTERN},
            ),
        ]
        | None
    ) = None
    tools: (
        Annotated[
            list[ToolName],
            Field(
                max_length=MAX_ITEMS,
                description=f"the tools offered to the model (default: {DEFAULT_AGENT}'s)",
            ),
        ]
        | None
    ) = None
    skills: Annotated[list[Name], Field(max_length=MAX_ITEMS)] = []
    servers: Annotated[
        list[Name],
        Field(max_length=MAX_ITEMS, description="Asset Directory servers whose tools it may use"),
    ] = []
    subagents: Annotated[
        list[Name],
        Field(
            max_length=MAX_ITEMS,
            description="agents (built-in or the tenant's) it may delegate work to with the "
            "delegate tool, each in a child task",
        ),
    ] = []
    permissions: Annotated[
        dict[PermissionKey, Permission],
        Field(
            description="allow, ask or deny per tool (default: reads allow, the rest ask); "
            "for a tool of one of its servers, by `server__tool` or `server__*` (default: "
            "allow for a tool the server marks read-only, else ask); an operator's "
            "HOLDFAST_TOOL_PERMISSIONS wins",
            json_schema_extra={
                "properties": {name: {"enum": ["allow", "ask", "deny"]} for name in _TOOL_NAMES},
                "patternProperties": {SERVER_RULE_PATTERN: {"enum": ["allow", "ask", "deny"]}},
                "additionalProperties": False,
            },
        ),
    ] = {}
    effects: Annotated[
        dict[EffectKey, Effect],
        Field(
            description="read_only, idempotent or effectful per tool: what the engine may do "
            "when a call's outcome is unknown (a read-only or idempotent call runs again with "
            "the same idempotency key; an effectful one is settled by a person). By tool "
            "(default: read_file and list_dir read_only, write_file idempotent, bash and "
            "edit_file effectful), `bash:<glob>` for the bash commands matching a glob, "
            "`server__tool` or `server__*` (default: from the tool's MCP annotations)",
            json_schema_extra={
                "properties": {name: _EFFECT_SCHEMA for name in DEFAULT_EFFECTS},
                "patternProperties": {
                    SERVER_RULE_PATTERN: _EFFECT_SCHEMA,
                    "^bash:.+$": _EFFECT_SCHEMA,
                },
                "additionalProperties": False,
            },
        ),
    ] = {}
    network: Annotated[
        bool,
        # Strict: a JSON boolean, not 0/1 or "true" (the schema says boolean).
        Field(strict=True, description="whether its tools' sandbox may use the network"),
    ] = False


class NewAgent(AgentSpec):
    """``POST /agents``'s body."""

    name: Annotated[str, Field(pattern=ID_PATTERN, description="unique among the tenant's")]


class AgentSummary(BaseModel):
    name: str
    description: str
    model: str | None
    tools: list[str]
    skills: list[str]
    servers: list[str]
    subagents: list[str]
    permissions: dict[str, Permission]
    effects: Annotated[
        dict[str, Effect],
        Field(
            description="the effect class of each of its tools a tool-runner runs, and its "
            "rules for others (server tools, bash command patterns)"
        ),
    ]
    network: bool
    builtin: bool
    # Epoch ms; None for a built-in.
    created_at: int | None
    updated_at: int | None


class Agent(AgentSummary):
    system_prompt: str


class AgentList(BaseModel):
    agents: list[AgentSummary]


def _ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def _describe(
    agent: AgentDefinition,
    row: AgentRecord | None = None,
    server_tools: list[ServerTool] | None = None,
) -> dict[str, Any]:
    return {
        "name": agent.name,
        "description": agent.description,
        "system_prompt": agent.system_prompt,
        "model": agent.model,
        "tools": list(agent.tools),
        "skills": list(agent.skills),
        "servers": list(agent.servers),
        "subagents": list(agent.subagents),
        "permissions": dict(agent.permissions),
        "effects": agent.tool_effects(server_tools or ()),
        "network": agent.network,
        "builtin": agent.builtin,
        "created_at": _ms(row.created_at) if row is not None else None,
        "updated_at": _ms(row.updated_at) if row is not None else None,
    }


async def _described(state: StateDep, tenant: str, row: AgentRecord) -> dict[str, Any]:
    """A custom agent as one agent's routes answer it: its servers' tools' classes too."""
    agent = from_record(row)
    async with state.sessions() as session:
        server_tools = await agent_server_tools(session, tenant, agent.servers)
    return _describe(agent, row, server_tools)


def _builtins_in_order() -> list[AgentDefinition]:
    """The default agent first, then the others by name."""
    agents = builtin_agents()
    return [agents[DEFAULT_AGENT], *(a for n, a in agents.items() if n != DEFAULT_AGENT)]


def _refuse_builtin(name: str) -> None:
    if name in builtin_agents():
        raise ApiError(
            409,
            ErrorCode.AGENT_BUILTIN,
            f"{name!r} is a built-in agent: built-ins ship with the engine and cannot be "
            "changed or deleted; create a custom agent under another name",
            {"agent": name},
        )


async def _check_references(state: StateDep, tenant: str, name: str, spec: AgentSpec) -> None:
    """422 naming each skill, server and subagent the tenant does not have (an
    agent may name itself as a subagent: delegation depth bounds it)."""
    async with state.sessions() as session:
        skills = await unknown_skills(session, tenant, spec.skills)
        servers = await unknown_servers(session, tenant, spec.servers)
        agents = [
            other
            for other in dict.fromkeys(spec.subagents)
            if other != name and await find_agent(session, tenant, other) is None
        ]
    problems = [
        {
            "loc": ["body", field, str(names.index(name))],
            "msg": f"unknown {kind} {name!r}",
            "type": f"unknown_{kind}",
        }
        for field, kind, names, unknown in (
            ("skills", "skill", spec.skills, skills),
            ("servers", "server", spec.servers, servers),
            ("subagents", "agent", spec.subagents, agents),
        )
        for name in unknown
    ]
    problems += [
        {
            "loc": ["body", field, key],
            "msg": f"{server_of_rule(key)!r} is not one of the agent's servers",
            "type": "unknown_server",
        }
        for field in ("permissions", "effects")
        for key in getattr(spec, field)
        if server_of_rule(key) is not None and server_of_rule(key) not in spec.servers
    ]
    if problems:
        summary = "; ".join(f"{'.'.join(p['loc'][1:])}: {p['msg']}" for p in problems)
        raise ApiError(
            422, ErrorCode.INVALID_REQUEST, f"invalid request: {summary}", {"errors": problems}
        )


def _values(spec: AgentSpec) -> dict[str, Any]:
    """The row's columns for ``spec``, as a turn will run it."""
    tools = list(dict.fromkeys(spec.tools)) if spec.tools is not None else None
    if tools is None:
        tools = list(builtin_agents()[DEFAULT_AGENT].tools)
    if spec.skills and SKILL.name not in tools:
        tools.append(SKILL.name)  # skills are used through it: an agent with skills has it
    if spec.subagents and DELEGATE.name not in tools:
        tools.append(DELEGATE.name)  # likewise for its subagents
    return {
        "description": spec.description,
        "system_prompt": spec.system_prompt,
        "model": spec.model,
        "tools": tools,
        "skills": list(dict.fromkeys(spec.skills)),
        "servers": list(dict.fromkeys(spec.servers)),
        "subagents": list(dict.fromkeys(spec.subagents)),
        "permissions": effective_permissions(tools, spec.permissions),
        "effects": dict(spec.effects),
        "network": spec.network,
    }


_NAME = Annotated[str, Path(pattern=ID_PATTERN)]


@router.get(
    "/agents",
    response_model=AgentList,
    responses=errors.responses(*errors.AUTHENTICATED),
    summary="The agents a turn can run as: the built-ins and the tenant's own",
)
async def list_agents(state: StateDep, tenant: TenantDep) -> dict[str, Any]:
    async with state.sessions() as session:
        rows = await custom_agents(session, tenant)
    described = [_describe(agent) for agent in _builtins_in_order()]
    described += [_describe(from_record(row), row) for row in rows]
    for agent in described:
        del agent["system_prompt"]
    return {"agents": described}


@router.post(
    "/agents",
    status_code=201,
    response_model=Agent,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 409),
    summary="Create a custom agent",
)
async def create_agent(
    state: StateDep, tenant: TenantDep, body: Annotated[NewAgent, Body()]
) -> dict[str, Any]:
    if body.name in builtin_agents():
        raise ApiError(
            409,
            ErrorCode.AGENT_EXISTS,
            f"{body.name!r} is the name of a built-in agent; choose another",
            {"agent": body.name},
        )
    await _check_references(state, tenant, body.name, body)
    async with state.sessions.begin() as session:
        row = await session.scalar(
            insert(AgentRecord)
            .values(tenant_id=tenant, name=body.name, **_values(body))
            .on_conflict_do_nothing()
            .returning(AgentRecord)
        )
    if row is None:
        raise ApiError(
            409,
            ErrorCode.AGENT_EXISTS,
            f"agent {body.name!r} exists; PUT /agents/{body.name} replaces it",
            {"agent": body.name},
        )
    return await _described(state, tenant, row)


@router.get(
    "/agents/{name}",
    response_model=Agent,
    responses=errors.responses(*errors.AUTHENTICATED, 404),
    summary="One agent, with its system prompt",
)
async def get_agent(state: StateDep, tenant: TenantDep, name: _NAME) -> dict[str, Any]:
    builtin = builtin_agents().get(name)
    if builtin is not None:
        return _describe(builtin)
    async with state.sessions() as session:
        row = await session.get(AgentRecord, (tenant, name))
    if row is None:
        raise agent_not_found(name)
    return await _described(state, tenant, row)


@router.put(
    "/agents/{name}",
    response_model=Agent,
    dependencies=[JsonBody],
    responses=errors.responses(*errors.AUTHENTICATED, *errors.WITH_BODY, 404, 409),
    summary="Replace a custom agent",
)
async def replace_agent(
    state: StateDep, tenant: TenantDep, name: _NAME, body: Annotated[AgentSpec, Body()]
) -> dict[str, Any]:
    _refuse_builtin(name)
    await _check_references(state, tenant, name, body)
    async with state.sessions.begin() as session:
        row = await session.scalar(
            update(AgentRecord)
            .where(AgentRecord.tenant_id == tenant, AgentRecord.name == name)
            .values(**_values(body), updated_at=func.now())
            .returning(AgentRecord)
        )
    if row is None:
        raise agent_not_found(name)
    return await _described(state, tenant, row)


@router.delete(
    "/agents/{name}",
    status_code=204,
    response_class=Response,
    responses=errors.responses(*errors.AUTHENTICATED, 404, 409),
    summary="Delete a custom agent",
)
async def delete_agent(state: StateDep, tenant: TenantDep, name: _NAME) -> Response:
    _refuse_builtin(name)
    async with state.sessions.begin() as session:
        deleted = await session.scalar(
            delete(AgentRecord)
            .where(AgentRecord.tenant_id == tenant, AgentRecord.name == name)
            .returning(AgentRecord.name)
        )
    if deleted is None:
        raise agent_not_found(name)
    return Response(status_code=204)
