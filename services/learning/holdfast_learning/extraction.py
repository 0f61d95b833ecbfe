"""What the learning centre asks a model to extract from a trajectory.

The model answers by calling one tool, ``record_memory``, whose input schema
is :class:`Extraction`'s: every provider enforces a tool's JSON schema (or
comes close), which makes it the portable way to get structured output. The
reply is validated again here; an invalid one is a failed attempt.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from holdfast_shared.tools import ToolSpec
from pydantic import BaseModel, ConfigDict, Field

EntityKind = Literal["person", "organisation", "project", "place", "other"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EpisodeOut(_Strict):
    summary: Annotated[str, Field(min_length=1, max_length=4000)] = Field(
        description="What happened in this turn, in one to three sentences, third person."
    )
    outcome: Annotated[str, Field(max_length=200)] = Field(
        default="", description="How it ended, in a few words (e.g. 'answered', 'failed: ...')."
    )
    participants: list[Annotated[str, Field(max_length=300)]] = Field(
        default_factory=list, description="Names of the people and organisations involved."
    )


class FactOut(_Strict):
    text: Annotated[str, Field(min_length=1, max_length=2000)] = Field(
        description="One atomic, self-contained statement, third person "
        '("The user\'s dog is called Rex.").'
    )
    key: Annotated[str, Field(max_length=200)] | None = Field(
        default=None,
        description="A short stable name for what the fact is about (e.g. 'user.dog.name'): "
        "a later fact with the same key replaces this one. Omit when none fits.",
    )
    confidence: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.8, description="How sure the trajectory makes this (0..1)."
    )


class EntityOut(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=300)]
    kind: EntityKind = "other"
    description: Annotated[str, Field(max_length=2000)] = ""


class RelationOut(_Strict):
    source: Annotated[str, Field(min_length=1, max_length=300)] = Field(
        description="The name of an entity in 'entities'."
    )
    relation: Annotated[str, Field(min_length=1, max_length=100)] = Field(
        description="snake_case, e.g. works_at, manages, sister_of, member_of."
    )
    target: Annotated[str, Field(min_length=1, max_length=300)] = Field(
        description="The name of an entity in 'entities'."
    )


class Extraction(_Strict):
    """Everything worth remembering from one trajectory."""

    episode: EpisodeOut
    facts: list[FactOut] = Field(default_factory=list, max_length=50)
    entities: list[EntityOut] = Field(default_factory=list, max_length=50)
    relations: list[RelationOut] = Field(default_factory=list, max_length=50)
    soul: Annotated[str, Field(max_length=20_000)] | None = Field(
        default=None,
        description="The whole revised soul document when this trajectory taught something "
        "about who the user is or how they like to work; null when it did not change.",
    )


def _inlined(node: Any, defs: dict[str, Any]) -> Any:
    """``node`` with every ``$ref`` replaced by its definition: not every
    provider's tool schema dialect follows references (Gemini's does not)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            return _inlined(defs[ref.rsplit("/", 1)[-1]], defs)
        return {k: _inlined(v, defs) for k, v in node.items() if k not in ("$defs", "title")}
    if isinstance(node, list):
        return [_inlined(item, defs) for item in node]
    return node


def _schema() -> dict[str, Any]:
    schema = Extraction.model_json_schema()
    inlined: dict[str, Any] = _inlined(schema, schema.get("$defs", {}))
    return inlined


RECORD_MEMORY = ToolSpec(
    "record_memory",
    "Record what is worth remembering from the trajectory. Call it exactly once.",
    _schema(),
)
