"""``POST /hitl/respond``'s check of an answer to an MCP server's question
(routes/hitl.py ``_check_elicited``): accepted content must match the server's
``requested_schema`` (422 naming each wrong field); decline and cancel carry
none. The whole path, over HTTP against a real server: tests/e2e/test_mcp_elicitation.py."""

from __future__ import annotations

from typing import Any

import pytest
from holdfast_gateway.errors import ApiError
from holdfast_gateway.routes.hitl import HitlAnswer, _check_elicited
from holdfast_shared.db.models import HitlRequestRecord

_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string", "format": "email"},
        "integer": {"type": "integer", "minimum": 1, "maximum": 100},
        "pet": {"type": "string", "enum": ["cat", "dog"]},
    },
    "required": ["name"],
}


def _row(schema: dict[str, Any] | None = _SCHEMA) -> HitlRequestRecord:
    tool_call = {"tool": "srv__ask", "tool_call_id": "c1"}
    if schema is not None:
        tool_call["requested_schema"] = schema  # type: ignore[assignment]
    return HitlRequestRecord(request_id="hitl_1", kind="elicitation", tool_call=tool_call)


def _answer(answer: str, content: dict[str, Any] | None = None) -> HitlAnswer:
    return HitlAnswer(task_id="task-1", answer=answer, content=content)


def _refused(row: HitlRequestRecord, answer: HitlAnswer) -> ApiError:
    with pytest.raises(ApiError) as refused:
        _check_elicited(row, answer)
    assert refused.value.status == 422
    return refused.value


def test_an_answer_matching_the_schema_passes() -> None:
    _check_elicited(_row(), _answer("accept", {"name": "Ada", "integer": 7, "pet": "cat"}))
    _check_elicited(_row(), _answer("decline"))
    _check_elicited(_row(), _answer(" Cancel "))


def test_each_wrong_field_is_named() -> None:
    error = _refused(
        _row(), _answer("accept", {"integer": 0, "pet": "fish", "email": "not-an-email"})
    )
    problems = {p["field"]: p["error"] for p in error.details["errors"]}
    assert set(problems) == {None, "integer", "pet", "email"}, problems
    assert "'name' is a required property" in problems[None]
    assert "integer: 0 is less than the minimum of 1" in error.message


def test_accept_needs_content_and_the_others_take_none() -> None:
    assert "needs content" in _refused(_row(), _answer("accept")).message
    assert "takes no content" in _refused(_row(), _answer("decline", {"name": "x"})).message


def test_a_request_without_a_schema_takes_any_object() -> None:
    _check_elicited(_row(None), _answer("accept", {"anything": True}))
