"""The result step (``turn/result.py``) on an in-memory turn: an answer checked
against the turn's output schema, corrected once, then ``OUTPUT_INVALID``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from holdfast_loop_worker.blocks import Block
from holdfast_loop_worker.turn import result
from holdfast_shared.errors import ErrorCode
from holdfast_shared.events import Result
from holdfast_shared.providers import ProviderError

from tests.loop_worker.fake_turn import FakeTurn

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0}},
    "required": ["n"],
}


def answer(text: str) -> list[Block]:
    return [Block("thinking", "hmm"), Block("text", text)]


def final(turn: FakeTurn) -> None:
    turn.state.stage, turn.state.stop_reason = "final", "end_turn"


def test_check_reads_json_and_says_where_it_is_wrong() -> None:
    assert result.check(SCHEMA, '{"n": 3}') == ({"n": 3}, [])
    assert result.check(SCHEMA, '```json\n{"n": 3}\n```') == ({"n": 3}, [])
    value, errors = result.check(SCHEMA, '{"n": -1}')
    assert value == {"n": -1}
    assert errors == [{"path": "/n", "message": "-1 is less than the minimum of 0"}]
    _, errors = result.check(SCHEMA, "Sure! n is 3.")
    assert errors[0]["message"].startswith("the answer is not JSON")
    # A draft named by $schema is the one applied (draft 4's boolean exclusiveMinimum).
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "minimum": 1}
    draft4["exclusiveMinimum"] = True
    assert (
        result.check(draft4, "1")[1][0]["message"] == "1 is less than or equal to the minimum of 1"
    )


def test_a_valid_answer_is_the_result() -> None:
    turn = FakeTurn(output_schema=SCHEMA)
    final(turn)
    assert result.judge(turn, answer('{"n": 3}')) is None
    assert turn.state.stage == "final" and turn.state.result == {"value": {"n": 3}}
    result.conclude(turn)
    assert result.events(turn) == [Result(result={"n": 3}, attempts=1)]
    assert result.stored(turn) == {"value": {"n": 3}}


def test_an_invalid_answer_is_asked_again_once_then_fails() -> None:
    turn = FakeTurn(output_schema=SCHEMA)
    final(turn)
    asked = result.judge(turn, answer('{"n": "three"}'))
    assert asked is not None
    assert turn.state.stage == "model" and turn.state.stop_reason is None
    [(role, content)] = turn.messages
    assert role == "user"
    said = content["blocks"][0]["text"]
    assert "- /n: 'three' is not of type 'integer'" in said

    final(turn)
    assert result.judge(turn, answer('{"m": 1}')) is None
    assert turn.state.stage == "final" and len(turn.messages) == 1, "asked once only"
    with pytest.raises(ProviderError) as failed:
        result.conclude(turn)
    assert failed.value.code == ErrorCode.OUTPUT_INVALID
    assert failed.value.details == {
        "errors": [{"path": "", "message": "'n' is a required property"}],
        "attempts": 2,
    }
    assert result.events(turn) == [] and result.stored(turn) is None


def test_a_null_result_is_a_result() -> None:
    turn = FakeTurn(output_schema={"type": ["object", "null"]})
    final(turn)
    assert result.judge(turn, answer("null")) is None
    assert result.events(turn) == [Result(result=None, attempts=1)]
    assert json.loads(result.events(turn)[0].model_dump_json())["result"] is None


def test_without_a_schema_nothing_happens() -> None:
    turn = FakeTurn()
    final(turn)
    assert result.judge(turn, answer("anything")) is None
    result.conclude(turn)
    assert turn.state.answers == 0 and result.events(turn) == []


def test_the_decision_survives_a_snapshot() -> None:
    turn = FakeTurn(output_schema=SCHEMA)
    final(turn)
    result.judge(turn, answer('{"n": 1}'))
    again = type(turn.state).from_json(json.loads(json.dumps(turn.state.to_json())))
    assert (again.answers, again.result, again.result_errors) == (1, {"value": {"n": 1}}, None)


def test_an_answer_postgresql_cannot_store_is_invalid() -> None:
    # A NUL meets the schema, but turns.result (JSONB) would refuse the turn's end.
    value, errors = result.check({"type": "object"}, '{"a": ["x\\u0000y"]}')
    assert value == {"a": ["x\x00y"]}
    assert [e["path"] for e in errors] == ["/a/0"]
