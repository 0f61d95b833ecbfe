"""The result step: a turn with an output schema ends with its answer validated.

A turn started with ``output_schema`` (the turn's row holds it) asks every
model call for JSON of that schema (each provider natively, see
``holdfast_shared.providers.structured``); its final answer — the text of the
call that ends the turn — is parsed and validated here with ``jsonschema``
(:func:`check`). Valid: the ``result`` event precedes ``completed`` and the
value is stored on the turn's row (``ending.py``, ``rows.py``). Invalid: the
model is asked once more with the errors, a user message of the
conversation (:func:`judge`, committed with the call's snapshot); invalid
again, the turn ends ``errored`` with ``OUTPUT_INVALID`` and the errors
(:func:`conclude`).

What was decided is in the turn's state (``TurnState.answers``,
``result``, ``result_errors``), snapshotted with the call, so a worker that
takes the turn over concludes the same way without asking again.
"""

from __future__ import annotations

import json
from typing import Any

from holdfast_shared.errors import ErrorCode
from holdfast_shared.events import Result
from holdfast_shared.providers import ProviderError

# No type stubs installed (types-jsonschema is not in the lock).
from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for
from sqlalchemy.dialects.postgresql import Insert

from holdfast_loop_worker.blocks import Block
from holdfast_loop_worker.turn.handle import TurnHandle

# The model's answers a turn takes: the first, and one corrected.
MAX_ANSWERS = 2
# Errors named to the model and in OUTPUT_INVALID's details, at most.
MAX_ERRORS = 20


def check(schema: dict[str, Any], text: str) -> tuple[Any, list[dict[str, str]]]:
    """The answer's JSON value and what is wrong with it for ``schema``
    (``[]``: valid). Each error has the JSON pointer of the value it is about
    (``path``) and ``jsonschema``'s message."""
    try:
        value = json.loads(_unfenced(text))
    except json.JSONDecodeError as exc:
        return None, [{"path": "", "message": f"the answer is not JSON: {exc}"}]
    validator = validator_for(schema, default=Draft202012Validator)(schema)
    try:
        found = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    except Exception as exc:
        # The gateway checked the schema, but a $ref that resolves to nothing
        # (referencing's Unresolvable, no public jsonschema class) shows only now.
        return value, [{"path": "", "message": f"the schema cannot be applied: {exc}"}]
    errors = [
        {"path": "".join(f"/{part}" for part in error.absolute_path), "message": error.message}
        for error in found[:MAX_ERRORS]
    ]
    if not errors and (where := _unstorable(value)) is not None:
        # A NUL in a string meets most schemas, but not the turn's row (JSONB).
        message = "a string PostgreSQL cannot store (a NUL or a lone surrogate)"
        errors = [{"path": where, "message": message}]
    return value, errors


def _unstorable(value: Any, path: str = "") -> str | None:
    """Where ``value`` holds a string with a NUL or a lone surrogate, if anywhere."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path
        return path if "\x00" in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _unstorable(key) is not None:
                return path
            if (found := _unstorable(item, f"{path}/{key}")) is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if (found := _unstorable(item, f"{path}/{index}")) is not None:
                return found
    return None


def _unfenced(text: str) -> str:
    # A model answering in prose (no native mode: extended thinking) often
    # fences its JSON in a Markdown code block.
    stripped = text.strip()
    if stripped.startswith("```") and stripped.endswith("```"):
        lines = stripped[3:-3].split("\n", 1)
        return lines[1] if len(lines) == 2 else ""
    return stripped


def answer_text(blocks: list[Block]) -> str:
    """The text of a model call: its answer."""
    parts = (block.to_content() for block in blocks)
    return "".join(part.get("text", "") for part in parts if part.get("type") == "text")


def judge(turn: TurnHandle, blocks: list[Block]) -> Insert | None:
    """The model ended its turn with ``blocks``: valid for the turn's schema,
    or asked again (the correction's message statement is returned, to be
    committed with the call's snapshot), or out of answers. Call before that
    snapshot; nothing to do without a schema."""
    schema, state = turn.output_schema, turn.state
    if schema is None:
        return None
    state.answers += 1
    value, errors = check(schema, answer_text(blocks))
    if not errors:
        state.result = {"value": value}
        return None
    if state.answers < MAX_ANSWERS:
        state.stage = "model"
        state.stop_reason = None
        return turn.message("user", {"blocks": [{"type": "text", "text": correction(errors)}]})
    state.result_errors = errors
    return None


def correction(errors: list[dict[str, str]]) -> str:
    """What the model is told of an invalid answer."""
    named = "\n".join(f"- {e['path'] or '(the answer)'}: {e['message']}" for e in errors)
    return (
        "Your answer does not match the required output schema:\n"
        f"{named}\n"
        "Answer again with only the JSON value the schema describes, corrected."
    )


def conclude(turn: TurnHandle) -> None:
    """Before the turn completes: an answer still invalid ends it ``errored``
    with ``OUTPUT_INVALID`` (details: the errors and the answers taken)."""
    errors = turn.state.result_errors
    if turn.output_schema is None or errors is None:
        return
    first = errors[0]["message"] if errors else "invalid"
    raise ProviderError(
        ErrorCode.OUTPUT_INVALID,
        f"the answer does not match the output schema after {turn.state.answers} tries: {first}",
        details={"errors": errors, "attempts": turn.state.answers},
    )


def events(turn: TurnHandle) -> list[Result]:
    """The ``result`` event the turn's ``completed`` follows (none without a result)."""
    found = turn.state.result
    if turn.output_schema is None or found is None:
        return []
    return [Result(result=found["value"], attempts=turn.state.answers)]


def stored(turn: TurnHandle) -> dict[str, Any] | None:
    """The validated result to store on the turn's row (``{"value": ...}``), if any."""
    return turn.state.result if turn.output_schema is not None else None
