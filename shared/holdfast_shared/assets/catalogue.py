"""An MCP server's tools as the model sees them: ``{server}__{tool}`` with its JSON Schema.

A server's tools are stored as last listed (``AssetServer.tools``: name,
description, inputSchema, annotations). The loop offers an agent the tools of
the servers it names, each under a name no other tool has — the server's name,
two underscores, the tool's own name, cut to the 64 characters and the
``[A-Za-z0-9_-]`` every provider accepts — and keeps which server and which
tool of it a name stands for (:class:`ServerTool`), so a call goes to the
right place even when a name had to be changed.

Permissions: a tool the server annotates ``readOnlyHint`` is ``allow`` by
default, any other ``ask`` (the MCP spec: annotations are hints from the
server, and a write must not run unasked). The agent's own rules (by the
tool's full name, or ``{server}__*`` for all of a server's) and the
operator's (``HOLDFAST_TOOL_PERMISSIONS``, the same names) win over the default.

Effect classes (``holdfast_shared.tools.Effect``): ``readOnlyHint`` makes a
tool ``read_only``, ``idempotentHint`` ``idempotent``, anything else (no
annotation, ``destructiveHint``) ``effectful``. The server's entry may set a
tool's class (``AssetServer.effects``, by the server's name for the tool), and
an agent's ``effects`` (by the full name or ``{server}__*``) wins over both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from holdfast_shared.tools import UNKNOWN_EFFECT, Effect, Permission, ToolSpec

SEPARATOR = "__"
MAX_NAME = 64
# Descriptions longer than this are cut: they are the model's context, every call.
MAX_DESCRIPTION = 2000
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_Rule = TypeVar("_Rule", bound=str)


@dataclass(frozen=True, slots=True)
class ServerTool:
    """One tool of an Asset Directory server, as offered to the model."""

    server: str
    tool: str  # the server's own name for it
    spec: ToolSpec  # under the model's name, ``{server}__{tool}``
    read_only: bool
    # What running it twice would do: its annotations', or its server entry's.
    effect: Effect = UNKNOWN_EFFECT

    @property
    def name(self) -> str:
        return self.spec.name

    def default_permission(self) -> Permission:
        return "allow" if self.read_only else "ask"


def model_name(server: str, tool: str) -> str:
    """The name the model calls ``tool`` of ``server`` by."""
    return _UNSAFE.sub("_", f"{server}{SEPARATOR}{tool}")[:MAX_NAME]


def server_wildcard(server: str) -> str:
    """The permission key that covers every tool of ``server``."""
    return f"{server}{SEPARATOR}*"


def annotation_effect(annotations: Mapping[str, Any]) -> Effect:
    """The effect class an MCP tool's annotations give (hints; unknown is effectful)."""
    if annotations.get("readOnlyHint"):
        return "read_only"
    if annotations.get("idempotentHint"):
        return "idempotent"
    return UNKNOWN_EFFECT


def listed_tool(tool: Any) -> dict[str, Any]:
    """A tool of a ``tools/list`` answer (the SDK's ``Tool``), as stored."""
    annotations = (
        tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else {}
    )
    return {
        "name": tool.name,
        "description": tool.description or tool.title or "",
        "inputSchema": tool.input_schema,
        "annotations": annotations,
    }


def _schema(raw: Any) -> dict[str, Any]:
    schema = dict(raw) if isinstance(raw, Mapping) else {}
    # Providers take plain JSON Schema objects; the dialect marker adds nothing.
    schema.pop("$schema", None)
    schema.setdefault("type", "object")
    if schema.get("type") == "object":
        schema.setdefault("properties", {})
    return schema


def server_tools(
    server: str,
    tools: Iterable[Mapping[str, Any]],
    effects: Mapping[str, Effect] | None = None,
) -> list[ServerTool]:
    """The stored ``tools`` of ``server`` as offered to the model, in the server's order;
    ``effects``: the server entry's classes, by the server's names for its tools."""
    found: list[ServerTool] = []
    taken: set[str] = set()
    for stored in tools:
        own = str(stored.get("name") or "")
        if not own:
            continue
        name = model_name(server, own)
        if name in taken:  # two names that differ only in characters we replaced
            continue
        taken.add(name)
        description = str(stored.get("description") or "")[:MAX_DESCRIPTION]
        annotations = stored.get("annotations") or {}
        found.append(
            ServerTool(
                server=server,
                tool=own,
                spec=ToolSpec(name, description, _schema(stored.get("inputSchema"))),
                read_only=bool(annotations.get("readOnlyHint")),
                effect=(effects or {}).get(own) or annotation_effect(annotations),
            )
        )
    return found


def rule_for(tool: ServerTool, rules: Mapping[str, _Rule]) -> _Rule | None:
    """The rule in ``rules`` (permissions or effect classes) for ``tool``: by its
    full name, else its server's ``*``."""
    return rules.get(tool.name) or rules.get(server_wildcard(tool.server))
