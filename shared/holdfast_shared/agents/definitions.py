"""Agent definitions: who the model is in a turn.

An agent is a system prompt (the first section of the model's context), the
tools offered to the model, a permission rule for each of them, the effect
class of those it wants classed otherwise than by default (``effects``), whether its
sandbox has the network, a preferred model, and the skills and Asset
Directory servers it may use. Two kinds, one shape (:class:`AgentDefinition`):

* **built-in** agents ship as files, ``builtin/<name>.md``: YAML front matter
  (``name``, ``description``, ``model``, ``tools``, ``permissions``,
  ``effects``, ``network``, ``skills``) and a Markdown body that is the system prompt.
  ``general`` is the agent of a turn that names none.
* **custom** agents are a tenant's own, created through ``/agents`` and
  stored in PostgreSQL (``store.py``).

Operators keep the last word over both (settings, applied by the services):
``HOLDFAST_AGENT_MODELS`` over the preferred model,
``HOLDFAST_TOOL_PERMISSIONS`` over the permissions, and
``HOLDFAST_NETWORK_AGENTS`` to grant the network.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Collection, Iterable, Mapping
from importlib import resources
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from holdfast_shared.assets.catalogue import ServerTool, rule_for
from holdfast_shared.errors import ErrorCode, HoldfastError
from holdfast_shared.modelspec import parse_model_spec
from holdfast_shared.skills.builtin import builtin_skills
from holdfast_shared.tools import (
    BASH_PATTERN_PREFIX,
    BUILTIN_BY_NAME,
    BUILTIN_TOOLS,
    DEFAULT_EFFECTS,
    DEFAULT_PERMISSIONS,
    DELEGATE,
    SKILL,
    Effect,
    Permission,
    ToolSpec,
    builtin_effect,
)

DEFAULT_AGENT = "general"


class AgentNotFound(HoldfastError):
    """No agent of that name for the tenant (neither built-in nor its own)."""

    def __init__(self, name: str) -> None:
        super().__init__(ErrorCode.AGENT_NOT_FOUND, f"agent {name!r} not found", {"agent": name})
        self.name = name


class AgentDefinition(BaseModel):
    """One agent, built-in or custom, as a turn runs it.

    ``permissions`` has a rule for each of ``tools`` (the agent's own, else
    :data:`~holdfast_shared.tools.DEFAULT_PERMISSIONS`); ``model`` is a
    preference, used when a loop-worker serves its provider (:func:`model_for`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    system_prompt: str
    model: str | None = None
    tools: tuple[str, ...]
    permissions: Mapping[str, Permission]
    # Effect classes over the defaults: by tool, ``{server}__{tool}``,
    # ``{server}__*``, or ``bash:<glob>`` for the bash commands matching it.
    effects: Mapping[str, Effect] = {}
    network: bool = False
    skills: tuple[str, ...] = ()
    servers: tuple[str, ...] = ()
    # The agents it may delegate to (the ``delegate`` tool, offered when any).
    subagents: tuple[str, ...] = ()
    builtin: bool = False

    def permission(self, tool: str) -> Permission:
        """The agent's rule for ``tool`` (before any operator override)."""
        return self.permissions.get(tool) or DEFAULT_PERMISSIONS.get(tool, "ask")

    def effect(
        self, tool: str, tool_input: Mapping[str, Any], server_tool: ServerTool | None = None
    ) -> Effect:
        """The effect class of one call: the agent's rule, else the tool's own
        (a built-in's default, a server tool's annotations or server entry)."""
        if server_tool is not None:
            return rule_for(server_tool, self.effects) or server_tool.effect
        return builtin_effect(tool, tool_input, self.effects)

    def tool_effects(self, server_tools: Iterable[ServerTool] = ()) -> dict[str, Effect]:
        """Each of its tool-runner tools' class (its servers' ``server_tools`` too),
        and its rules for others (bash command patterns, servers' wildcards): what
        ``GET /agents/{name}`` shows."""
        classes: dict[str, Effect] = {
            tool: self.effects.get(tool) or DEFAULT_EFFECTS[tool]
            for tool in self.tools
            if tool in DEFAULT_EFFECTS
        }
        classes.update({tool.name: self.effect(tool.name, {}, tool) for tool in server_tools})
        return {**classes, **{k: v for k, v in self.effects.items() if k not in classes}}

    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """The tools offered to the model, in the catalogue's order (stable, for caches).

        ``skill`` only when the agent has skills, its ``name`` an enum of them;
        ``delegate`` likewise with its subagents.
        """
        specs = []
        for tool in BUILTIN_TOOLS:
            if tool.name not in self.tools:
                continue
            if tool.name == SKILL.name:
                if not self.skills:
                    continue
                tool = _skill_tool(self.skills)
            elif tool.name == DELEGATE.name:
                if not self.subagents:
                    continue
                tool = _delegate_tool(self.subagents)
            specs.append(tool)
        return tuple(specs)


@functools.lru_cache(maxsize=256)
def _skill_tool(skills: tuple[str, ...]) -> ToolSpec:
    """The ``skill`` tool for an agent with ``skills``: its names the only choice."""
    schema = copy.deepcopy(SKILL.input_schema)
    schema["properties"]["name"]["enum"] = list(skills)
    return ToolSpec(SKILL.name, SKILL.description, schema)


@functools.lru_cache(maxsize=256)
def _delegate_tool(subagents: tuple[str, ...]) -> ToolSpec:
    """The ``delegate`` tool for an agent with ``subagents``: their names the only choice."""
    schema = copy.deepcopy(DELEGATE.input_schema)
    schema["properties"]["agent"]["enum"] = list(subagents)
    return ToolSpec(DELEGATE.name, DELEGATE.description, schema)


def check_tool(name: str) -> str:
    """``name`` if it is a tool of the catalogue; else ValueError naming it."""
    if name not in BUILTIN_BY_NAME:
        known = ", ".join(BUILTIN_BY_NAME)
        raise ValueError(f"unknown tool {name!r}; the tools are: {known}")
    return name


# A rule for an Asset Directory server's tool: ``{server}__{tool}``, or
# ``{server}__*`` for all of the server's (holdfast_shared.assets.catalogue).
SERVER_RULE_PATTERN = r"^[A-Za-z0-9]+(?:[-_][A-Za-z0-9]+)*__(?:\*|[A-Za-z0-9_-]{1,64})$"
_SERVER_RULE = re.compile(SERVER_RULE_PATTERN)


def server_of_rule(name: str) -> str | None:
    """The server a permission rule's key names (``{server}__...``), else None."""
    return name.split("__", 1)[0] if _SERVER_RULE.match(name) else None


def check_permission_key(name: str) -> str:
    """``name`` if it can carry a permission rule: a tool of the catalogue, or an
    Asset Directory server's tool (``{server}__{tool}``, ``{server}__*``)."""
    if server_of_rule(name) is not None:
        return name
    return check_tool(name)


def check_effect_key(name: str) -> str:
    """``name`` if it can carry an effect class: what carries a permission rule, or
    ``bash:<glob>`` (the bash commands matching the glob)."""
    if name.startswith(BASH_PATTERN_PREFIX):
        if not name[len(BASH_PATTERN_PREFIX) :]:
            raise ValueError(f"{name!r}: a bash rule needs a command pattern after 'bash:'")
        return name
    check_permission_key(name)
    if name in BUILTIN_BY_NAME and name not in DEFAULT_EFFECTS:
        raise ValueError(f"{name!r} is run by the loop itself: it has no effect class")
    return name


def effective_permissions(
    tools: Iterable[str], given: Mapping[str, Permission]
) -> dict[str, Permission]:
    """A rule for each of ``tools``: ``given``'s, else the default. Rules for
    tools the agent does not have are dropped (they could never apply); rules
    for its servers' tools are kept as given (the server's annotations give the
    default, when the tool is called)."""
    for name in given:
        check_permission_key(name)
    rules = {tool: given.get(tool) or DEFAULT_PERMISSIONS.get(tool, "ask") for tool in tools}
    rules.update({name: rule for name, rule in given.items() if server_of_rule(name)})
    return rules


def model_for(
    agent: AgentDefinition,
    *,
    requested: str | None,
    overrides: Mapping[str, str],
    served: Collection[str],
) -> str | None:
    """The model a turn of ``agent`` runs on; None: the engine's default.

    In order: the request's own ``model``; the operator's model for the agent
    (``HOLDFAST_AGENT_MODELS``); the agent's preferred model when a
    loop-worker serves its provider (``served``: provider names).
    """
    if requested:
        return requested
    if spec := overrides.get(agent.name):
        return spec
    if agent.model and parse_model_spec(agent.model).provider in served:
        return agent.model
    return None


# -- built-in agents: files ------------------------------------------------------

_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n---[ \t]*\r?\n(.*)\Z", re.DOTALL)


class _FrontMatter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,63}$")
    description: str = Field(min_length=1)
    model: str | None = None
    tools: list[str]
    permissions: dict[str, Permission] = {}
    effects: dict[str, Effect] = {}
    network: bool = False
    skills: list[str] = []
    subagents: list[str] = []


def parse_agent_file(text: str) -> AgentDefinition:
    """A built-in agent from its file; ValueError naming what is wrong."""
    found = _FRONT_MATTER.match(text)
    if found is None:
        raise ValueError("an agent file starts with YAML front matter between '---' lines")
    try:
        raw: Any = yaml.safe_load(found[1])
        front = _FrontMatter.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as exc:
        raise ValueError(f"invalid front matter: {exc}") from None
    for tool in front.tools:
        check_tool(tool)
    for key in front.effects:
        check_effect_key(key)
    # A built-in agent has built-in skills only (a tenant's are checked in store.py).
    unknown = [skill for skill in front.skills if skill not in builtin_skills()]
    if unknown:
        raise ValueError(f"unknown skill {unknown[0]!r}")
    if front.model is not None:
        parse_model_spec(front.model)
    prompt = found[2].strip()
    if not prompt:
        raise ValueError("the body (the system prompt) is empty")
    tools = tuple(dict.fromkeys(front.tools))
    return AgentDefinition(
        name=front.name,
        description=front.description,
        system_prompt=prompt,
        model=front.model,
        tools=tools,
        permissions=effective_permissions(tools, front.permissions),
        effects=front.effects,
        network=front.network,
        skills=tuple(front.skills),
        subagents=tuple(dict.fromkeys(front.subagents)),
        builtin=True,
    )


@functools.cache
def builtin_agents() -> Mapping[str, AgentDefinition]:
    """The built-in agents by name, read once from the package's files.

    A broken file is an error here (ValueError naming it), so a service that
    starts with a broken build stops at start, not mid-turn.
    """
    agents: dict[str, AgentDefinition] = {}
    folder = resources.files("holdfast_shared.agents") / "builtin"
    for entry in sorted(folder.iterdir(), key=lambda item: item.name):
        if not entry.name.endswith(".md"):
            continue
        try:
            agent = parse_agent_file(entry.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"built-in agent {entry.name}: {exc}") from None
        if f"{agent.name}.md" != entry.name:
            raise ValueError(f"built-in agent {entry.name} is named {agent.name!r}")
        agents[agent.name] = agent
    if DEFAULT_AGENT not in agents:
        raise ValueError(f"no built-in agent {DEFAULT_AGENT!r}")
    for agent in agents.values():
        unknown = [name for name in agent.subagents if name not in agents]
        if unknown:
            raise ValueError(f"built-in agent {agent.name}: unknown subagent {unknown[0]!r}")
    return MappingProxyType(agents)
