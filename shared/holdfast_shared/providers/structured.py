"""Structured output: how a turn's ``output_schema`` is asked of each provider.

A turn with ``output_schema`` (``ModelRequest.output_schema``) wants its final
answer as JSON for that schema. Each provider asks for it natively — OpenAI's
``response_format`` (``json_schema``), Gemini's JSON response schema,
Anthropic by tool-forcing: an extra tool, :data:`OUTPUT_TOOL`, whose input is
the answer — and every provider hands the answer back the same way, as the
text of the call (Anthropic's adapter turns the output tool's call into a
text block), so the loop-worker reads one thing whatever the model: the last
call's text, which it validates (``turn/result.py``).

Only the agent's own steps ask (``purpose="turn"``): a compaction summary or
a skill's sub-call answers in prose.
"""

from __future__ import annotations

import json
from typing import Any

from holdfast_shared.providers.base import ModelRequest

# Anthropic's output tool (tool-forcing): calling it is giving the answer.
OUTPUT_TOOL = "final_result"
OUTPUT_TOOL_DESCRIPTION = (
    "Give your final answer by calling this tool: its input is the answer, which must "
    "match the schema. Call it once you are done (after any other tools you need)."
)
# The name the schema goes by where an API wants one (OpenAI's json_schema.name).
SCHEMA_NAME = "result"
# A schema whose root is not an object is wrapped in one where the API's tool
# input must be an object (Anthropic): the answer is this property's value.
WRAPPED_PROPERTY = "result"


def instruction(schema: dict[str, Any]) -> str:
    """The schema asked for in words, where an API cannot ask natively (Gemini
    before 3 with tools): the answer is validated all the same."""
    return (
        "Your final answer, once you need no more tools, must be only a JSON value "
        "matching this JSON Schema, with no other text:\n"
        + json.dumps(schema, separators=(",", ":"))
    )


def wanted(request: ModelRequest) -> dict[str, Any] | None:
    """The schema this call's answer must meet; None when it asks for none."""
    if request.purpose != "turn":
        return None
    return request.output_schema


def is_object_schema(schema: dict[str, Any]) -> bool:
    """Whether the schema's root is an object (a tool's input can be it as is)."""
    return schema.get("type") == "object"


def tool_input_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The output tool's input schema: the schema itself when its root is an
    object, else an object holding it as :data:`WRAPPED_PROPERTY`."""
    if is_object_schema(schema):
        return schema
    return {
        "type": "object",
        "properties": {WRAPPED_PROPERTY: schema},
        "required": [WRAPPED_PROPERTY],
    }
