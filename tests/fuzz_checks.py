"""Schemathesis hooks for ``tests/test_fuzz.py``: the engine's own checks.

Loaded by the Schemathesis run itself (its ``hooks`` setting), not by pytest.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis
from schemathesis.core.failures import Failure


class RefusedValidData(Failure):
    kind_title = "Valid data refused"


@schemathesis.check
def valid_requests_are_accepted(ctx: Any, response: Any, case: Any) -> bool | None:
    """Data the description allows is not refused as malformed (400, 415 or 422).

    Replaces Schemathesis' ``positive_data_acceptance``, with two exceptions:
    ``MODEL_UNAVAILABLE``, a well-formed model whose provider no running
    loop-worker serves (the test engine runs only the scripted one), and
    ``UNSUPPORTED_MEDIA``, a well-formed media item of a type the turn's
    model cannot take (never with the scripted model, which takes any). A body
    over ``HOLDFAST_MAX_BODY_BYTES`` is a 413, documented, and not refused
    as malformed either.
    """
    if case.meta is None or not case.meta.generation.mode.is_positive:
        return None
    if response.status_code not in (400, 415, 422):
        return None
    try:
        code = json.loads(response.content).get("error")
    except (ValueError, AttributeError):
        code = None
    if code in ("MODEL_UNAVAILABLE", "UNSUPPORTED_MEDIA"):
        return None
    raise RefusedValidData(
        operation=case.operation.label,
        message=f"{response.status_code}: {response.content[:1000]!r}",
    )
