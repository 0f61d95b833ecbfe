"""Schemathesis hooks for ``tests/gateway/test_fuzz.py``: the engine's own checks.

Loaded by the Schemathesis run itself (its ``hooks`` setting), not by pytest.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from schemathesis.core.failures import Failure


class RefusedValidData(Failure):
    kind_title = "Valid data refused"


# Names of things the tenant has not stored (an agent's skills, servers and subagents);
# lines of a memory import that collide with the brain's rows or each other,
# relate entities that are nowhere, or give a date-time that is no instant of
# the years 1-9999 in UTC ("0001-01-01T00:00:00+01:00"): no schema can say so.
_NOT_STORED = {
    "unknown_skill",
    "unknown_server",
    "unknown_agent",
    "conflict",
    "duplicate",
    "unknown_entity",
    "datetime_out_of_range",
    # POST /execute's edit_message_id / retry_message_id: a message the task
    # does not have, has taken off its branch, or that no user sent; a
    # GET /tasks cursor the list did not hand out.
    "unknown_message",
    "message_off_branch",
    "not_a_user_message",
    "unknown_cursor",
    # A JSON object for a JSONB column (an execution's state) with a NUL or a
    # lone surrogate somewhere inside: PostgreSQL cannot store it, and JSON
    # Schema cannot say so of every nested key and string.
    "unstorable_json",
    # A webhook given by a tenant that has no signing secret yet (POST /webhooks/secret).
    "no_signing_secret",
    # POST /schedules: a cron expression cronsim does not parse (or that never
    # matches), a time zone the IANA database does not have, an `at` already past.
    "invalid_cron",
    "unknown_timezone",
    "in_the_past",
    # output_schema (/execute, /v1/execution, /schedules): an object that is not
    # a JSON Schema by its metaschema, over 32 KiB, or referring outside itself.
    "not_a_json_schema",
}


@schemathesis.serializer("application/x-ndjson")
def ndjson(ctx: Any, value: Any) -> bytes:
    """``POST /memory/import``'s body: the schema's array, one item per line."""
    items = value if isinstance(value, list) else [value]
    return b"".join(json.dumps(item).encode() + b"\n" for item in items)


@schemathesis.check
def valid_requests_are_accepted(ctx: Any, response: Any, case: Any) -> bool | None:
    """Data the description allows is not refused as malformed (400, 415 or 422).

    Replaces Schemathesis' ``positive_data_acceptance``, with two exceptions:
    ``MODEL_UNAVAILABLE``, a well-formed model whose provider no running
    loop-worker serves (the test engine runs only the scripted one), and
    ``UNSUPPORTED_MEDIA``, a well-formed media item of a type the turn's
    model cannot take (never with the scripted model, which takes any), and
    ``ASSET_UNAVAILABLE``, a well-formed MCP server (a URL, a command) that
    does not answer as one — what runs out there is not the schema's to say; and
    an agent's skill, server or subagent the tenant does not have
    (``INVALID_REQUEST`` whose every error is ``unknown_skill`` /
    ``unknown_server`` / ``unknown_agent``: what exists
    is the store's to say, not the schema's), and memory import lines that
    collide with the brain or each other (``conflict``, ``duplicate``),
    relate unknown entities (``unknown_entity``) or give an instant outside
    the years 1-9999 in UTC (``datetime_out_of_range``). A body over
    ``HOLDFAST_MAX_BODY_BYTES`` is a 413, documented, and not refused as
    malformed either.
    """
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    if response.status_code not in (400, 415, 422):
        return None
    try:
        body = json.loads(response.content)
        code = body.get("error")
        problems = {e.get("type") for e in (body.get("details") or {}).get("errors", [])}
    except (ValueError, AttributeError):
        code, problems = None, set()
    # DESTINATION_NOT_ALLOWED: a well-formed URL leading where the outbound policy
    # refuses to connect (loopback, private...): where it leads is not the schema's.
    # IDEMPOTENCY_KEY_REUSED: an Idempotency-Key an earlier request of the run
    # came with (a fuzzer repeats short values): what was sent before is the store's.
    if code in (
        "MODEL_UNAVAILABLE",
        "UNSUPPORTED_MEDIA",
        "ASSET_UNAVAILABLE",
        "DESTINATION_NOT_ALLOWED",
        "IDEMPOTENCY_KEY_REUSED",
    ):
        return None
    if code == "INVALID_REQUEST" and problems and problems <= _NOT_STORED:
        return None
    raise RefusedValidData(
        operation=case.operation.label,
        message=f"{response.status_code}: {response.content[:1000]!r}",
    )
