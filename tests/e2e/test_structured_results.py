"""Structured results (#27) end to end: ``output_schema`` on ``/execute`` and
``/v1/execution`` through real gateway and worker processes, the scripted model
answering as its script says (``results``: one answer per attempt).

A valid answer ends the turn with a ``result`` event before ``completed``, and
``GET /tasks/{task_id}`` (``last_result``) and the execution carry it; an
invalid one is corrected once (the model is told the errors); invalid twice,
the turn ends ``errored`` with ``OUTPUT_INVALID``; a schema that is not one
is a 422 before anything is written.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from holdfast_client import AsyncClient

from tests.processes import EngineProcesses
from tests.sse_client import Received, execute, replay
from tests.waiting import until

pytestmark = pytest.mark.timeout(90)

ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "unit": {"type": "string"}},
    "required": ["answer"],
}


def script(**kw: object) -> str:
    return "/script " + json.dumps(kw)


def one(got: Received, kind: str) -> dict[str, Any]:
    found = [e for e in got.events if e["type"] == kind]
    assert len(found) == 1, got.types
    return found[0]


async def _get(client: httpx.AsyncClient, url: str, key: str) -> dict[str, Any]:
    reply = await client.get(url, headers={"X-Engine-Key": key})
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


async def test_a_valid_answer_ends_the_turn_with_its_result(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    body = {
        "message": script(result={"answer": 42, "unit": "apples"}),
        "output_schema": ANSWER,
    }
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(client, engine.url, key, body)
        assert got.status == 200, got.body
        task_id = got.headers["x-task-id"]
        # The answer streams as text, then its value comes just before the end.
        assert json.loads(got.text) == {"answer": 42, "unit": "apples"}
        assert got.types[-3:] == ["usage", "result", "thread_lifecycle"]
        result = one(got, "result")
        assert result["result"] == {"answer": 42, "unit": "apples"}
        assert result["attempts"] == 1
        assert got.events[-1]["phase"] == "completed"

        async def stored() -> bool:
            task = await _get(client, f"{engine.url}/tasks/{task_id}", key)
            return task["last_result"] is not None

        await until(stored, "the result on GET /tasks")
        task = await _get(client, f"{engine.url}/tasks/{task_id}", key)
        assert task["last_result"]["result"] == {"answer": 42, "unit": "apples"}
        assert task["last_result"]["turn_id"] == got.events[0]["turn_id"]

        # A later turn without a schema leaves the last result as it was.
        later = await execute(client, engine.url, key, {"message": "hi", "task_id": task_id})
        assert "result" not in later.types
        task = await _get(client, f"{engine.url}/tasks/{task_id}", key)
        assert task["last_result"]["turn_id"] == got.events[0]["turn_id"]


async def test_a_schema_whose_root_is_not_an_object(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    body = {
        "message": script(result=[3, 1, 2]),
        "output_schema": {"type": "array", "items": {"type": "integer"}, "minItems": 3},
    }
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(client, engine.url, api_keys["main"], body)
    assert one(got, "result")["result"] == [3, 1, 2]
    assert got.events[-1]["phase"] == "completed"


async def test_an_invalid_answer_is_corrected_once(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    body = {
        "message": script(results=[{"answer": "forty-two"}, {"answer": 42}]),
        "output_schema": ANSWER,
    }
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(client, engine.url, key, body)
        task_id = got.headers["x-task-id"]
        result = one(got, "result")
        assert result["result"] == {"answer": 42}
        assert result["attempts"] == 2
        assert got.events[-1]["phase"] == "completed"
        # Both answers were shown (two model calls), the corrected one last.
        assert got.types.count("content_block_start") == 2
        assert got.text.endswith(json.dumps({"answer": 42}))
        # The correction is part of the conversation: the model saw the errors.
        reply = await client.get(
            f"{engine.url}/tasks/{task_id}/messages", headers={"X-Engine-Key": key}
        )
    messages = reply.json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    correction = messages[2]["content"]["blocks"][0]["text"]
    assert "/answer" in correction and "'forty-two' is not of type 'integer'" in correction


async def test_an_answer_invalid_twice_ends_the_turn_output_invalid(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    body = {"message": script(results=[{"unit": "none"}]), "output_schema": ANSWER}
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(client, engine.url, key, body)
        task_id = got.headers["x-task-id"]
        assert "result" not in got.types
        assert got.types[-2:] == ["error", "thread_lifecycle"]
        assert got.events[-1]["phase"] == "errored"
        error = got.events[-2]
        assert error["error"] == "OUTPUT_INVALID"
        assert error["details"]["attempts"] == 2
        assert error["details"]["errors"] == [
            {"path": "", "message": "'answer' is a required property"}
        ]
        assert got.types.count("content_block_start") == 2, "asked once more, not again"
        task = await _get(client, f"{engine.url}/tasks/{task_id}", key)
    assert task["last_result"] is None


async def test_an_answer_that_is_not_json(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    # No result in the script: the scripted model echoes, in prose.
    body = {"message": "just talk", "output_schema": ANSWER}
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(client, engine.url, api_keys["main"], body)
    error = one(got, "error")
    assert error["error"] == "OUTPUT_INVALID"
    assert error["details"]["errors"][0]["message"].startswith("the answer is not JSON")


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "objekt"}, "is not a valid JSON Schema"),
        ({"type": "object", "properties": {"n": {"minimum": "1"}}}, "/properties/n/minimum"),
        ({"type": "string", "pattern": "("}, "is not a valid JSON Schema"),
        ({"enum": ["x" * 100] * 400}, "bytes of JSON; at most 32768"),
        # Validation would fetch it, from the worker's network: refused.
        ({"$ref": "http://127.0.0.1:9/schema.json"}, "only local references"),
        ({"$schema": ["draft"]}, "$schema must be a string"),
    ],
)
async def test_a_schema_that_is_not_one_is_a_422(
    engine: EngineProcesses, api_keys: dict[str, str], schema: dict[str, Any], says: str
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        for path, body in (
            ("/execute", {"message": "hi", "task_id": "structured-422"}),
            ("/v1/execution", {"name": "n", "input": "hi"}),
        ):
            reply = await client.post(
                f"{engine.url}{path}",
                json={**body, "output_schema": schema},
                headers={"X-Engine-Key": key},
            )
            assert reply.status_code == 422, reply.text
            error = reply.json()
            assert error["error"] == "INVALID_REQUEST"
            assert says in error["message"]
            [problem] = error["details"]["errors"]
            assert problem["loc"] == ["body", "output_schema"]
            assert problem["type"] == "not_a_json_schema"
        # Nothing was written: the task does not exist.
        missing = await client.get(
            f"{engine.url}/tasks/structured-422", headers={"X-Engine-Key": key}
        )
    assert missing.status_code == 404


async def test_a_schema_postgresql_cannot_store_is_a_422(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(
            f"{engine.url}/execute",
            json={"message": "hi", "output_schema": {"description": "a\u0000b"}},
            headers={"X-Engine-Key": api_keys["main"]},
        )
    assert reply.status_code == 422, reply.text
    [problem] = reply.json()["details"]["errors"]
    assert problem["type"] == "unstorable_json" and problem["loc"][:2] == ["body", "output_schema"]


async def test_a_schema_must_be_an_object_and_wait_for_its_turn(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        not_object = await client.post(
            f"{engine.url}/execute",
            json={"message": "hi", "output_schema": ["type", "object"]},
            headers={"X-Engine-Key": key},
        )
        queued = await client.post(
            f"{engine.url}/execute",
            json={"message": "hi", "output_schema": ANSWER, "on_busy": "enqueue"},
            headers={"X-Engine-Key": key},
        )
    assert not_object.status_code == 422, not_object.text
    assert queued.status_code == 422, queued.text
    assert queued.json()["details"]["errors"][0]["loc"] == ["body", "on_busy"]


async def test_an_execution_carries_its_result(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        created = await client.post(
            f"{engine.url}/v1/execution",
            json={
                "name": "structured",
                "input": script(results=[{"answer": "x"}, {"answer": 7, "unit": "days"}]),
                "output_schema": ANSWER,
            },
            headers={"X-Engine-Key": key},
        )
        assert created.status_code == 201, created.text
        execution_id = created.json()["id"]
        assert created.json()["result"] is None
        log = await replay(client, engine.url, key, {"task_id": execution_id, "after_seq": 0})
        assert one(log, "result")["result"] == {"answer": 7, "unit": "days"}

        async def completed() -> bool:
            got = await _get(client, f"{engine.url}/v1/execution/{execution_id}", key)
            return bool(got["status"] == "completed")

        await until(completed, "the execution completed")
        got = await _get(client, f"{engine.url}/v1/execution/{execution_id}", key)
        assert got["result"] == {"answer": 7, "unit": "days"}
        listed = await _get(client, f"{engine.url}/v1/execution", key)
    mine = [e for e in listed["executions"] if e["id"] == execution_id]
    assert mine and mine[0]["result"] == {"answer": 7, "unit": "days"}


async def test_the_python_client_sends_the_schema_and_reads_the_result(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with AsyncClient(engine.url, api_keys["main"]) as client:
        turn = client.stream(script(result={"answer": 5}), output_schema=ANSWER)
        done = await turn.until_done()
        assert done.result == {"answer": 5}
        assert json.loads(done.text) == {"answer": 5}
        created = await client.create_execution(
            {"name": "n", "input": script(result={"answer": 6}), "output_schema": ANSWER}
        )
    assert "result" in created  # null until its turn completes
