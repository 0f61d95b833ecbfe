"""``output_schema`` (``/execute``, ``/v1/execution``, schedules): a JSON Schema
the turn's final answer must meet.

Checked here before anything is written — a JSON object, at most
:data:`MAX_OUTPUT_SCHEMA_BYTES` of JSON, and a schema by its own metaschema
(``jsonschema``'s ``check_schema``; the draft its ``$schema`` names, else
2020-12, as the loop-worker validates with) — so a bad one is a 422 naming
the field, never a turn that fails later. The loop-worker asks the model for
it and validates the answer (``turn/result.py`` there).

References stay inside the schema (``"$ref": "#/$defs/..."``): jsonschema
would fetch any other URL when validating, from the loop-worker's network,
unchecked by the outbound policy.
"""

from __future__ import annotations

import functools
import json
from typing import Any

# No type stubs installed (types-jsonschema is not in the lock).
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for

from holdfast_gateway.errors import ApiError
from holdfast_gateway.forks import invalid_field

_REFERENCES = frozenset({"$ref", "$dynamicRef", "$recursiveRef"})

# A schema rides along every model call of the turn (the providers' native
# structured output), so it is kept to the size of a large tool's.
MAX_OUTPUT_SCHEMA_BYTES = 32_768

FIELD = "output_schema"
DESCRIPTION = (
    "a JSON Schema the turn's final answer must meet: the model is asked for it natively, "
    "the answer is validated (asked once more with the errors when invalid) and ends the "
    "turn as a `result` event (README, Structured results)"
)


def checked(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """The schema when it is one; a 422 ``INVALID_REQUEST`` naming
    ``output_schema`` otherwise."""
    if schema is None:
        return None
    try:
        return _checked(schema)
    except RecursionError:
        raise _invalid("is nested too deeply") from None


def _checked(schema: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(schema, separators=(",", ":"), sort_keys=True)
    size = len(text.encode())
    if size > MAX_OUTPUT_SCHEMA_BYTES:
        raise _invalid(f"is {size} bytes of JSON; at most {MAX_OUTPUT_SCHEMA_BYTES}")
    if not isinstance(schema.get("$schema", ""), str):
        raise _invalid("$schema must be a string (the URI of a JSON Schema draft)")
    if (remote := _remote_reference(schema)) is not None:
        raise _invalid(f"refers outside itself ({remote!r}); only local references (#...)")
    if (wrong := _metaschema_error(text)) is not None:
        raise _invalid(f"is not a valid JSON Schema: {wrong}")
    return schema


# Checking a schema against the 2020-12 metaschema takes ~10 ms ($dynamicRef
# resolution): an application sends the same few schemas again and again, so
# the verdicts on the latest ones are kept, by the schema's canonical JSON.
@functools.lru_cache(maxsize=256)
def _metaschema_error(text: str) -> str | None:
    """What is wrong with the schema ``text`` by its metaschema (``check_schema``
    with its format checks: a ``pattern`` must be a regex); None: nothing."""
    schema = json.loads(text)
    drafts = validator_for(schema, default=Draft202012Validator)
    metaschema = drafts(drafts.META_SCHEMA, format_checker=drafts.FORMAT_CHECKER)
    error = best_match(metaschema.iter_errors(schema))
    if error is None:
        return None
    where = "".join(f"/{part}" for part in error.absolute_path)
    return f"{error.message} (at {where or '/'})"


def _remote_reference(value: Any) -> str | None:
    """The first reference in ``value`` that does not point inside the schema."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in _REFERENCES and isinstance(item, str) and not item.startswith("#"):
                return item
            if (found := _remote_reference(item)) is not None:
                return found
    elif isinstance(value, list):
        for item in value:
            if (found := _remote_reference(item)) is not None:
                return found
    return None


def _invalid(message: str) -> ApiError:
    # Its own type: whether an object is a JSON Schema is its metaschema's to
    # say, which the OpenAPI description cannot carry (the fuzzer knows it).
    return invalid_field(FIELD, message, "not_a_json_schema")
