"""Black-box: a turn through real gateway and worker processes, read with a real SSE client."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
from holdfast_shared.db.models import Message
from holdfast_shared.events import parse_event
from sqlalchemy import func, select

from tests.chaos.invariants import visible_text
from tests.processes import EngineProcesses
from tests.sse_client import Received, execute, replay
from tests.taskids import engine_task_id

pytestmark = pytest.mark.timeout(60)


def script(**kw: object) -> str:
    return "/script " + json.dumps(kw)


def assert_gapless(got: Received, first: int = 1) -> None:
    assert got.seqs == list(range(first, first + len(got.seqs))), got.seqs
    stamps = [e["timestamp"] for e in got.events]
    assert all(b > a for a, b in itertools.pairwise(stamps)), stamps


async def test_full_turn_event_sequence(engine: EngineProcesses, api_keys: dict[str, str]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(client, engine.url, api_keys["main"], {"message": "hello world"})
    assert got.status == 200
    task_id = got.headers["x-task-id"]
    assert got.types[0] == "thread_lifecycle" and got.events[0]["phase"] == "started"
    assert got.types[1] == "content_block_start"
    assert got.events[1]["block_type"] == "text" and got.events[1]["block_index"] == 0
    deltas = got.types[2:-3]
    assert deltas and set(deltas) == {"text_delta"}
    assert got.types[-3:] == ["content_block_stop", "usage", "thread_lifecycle"]
    assert got.events[-1]["phase"] == "completed"
    assert got.events[-1]["stop_reason"] == "end_turn"
    assert got.text == "You said: hello world"
    assert got.events[-2]["output_tokens"] == 4
    assert_gapless(got)
    for event in got.events:
        assert event["task_id"] == task_id
        assert event["turn_id"] == got.events[0]["turn_id"]
        assert isinstance(event["timestamp"], int)
        parse_event(json.dumps(event))  # every event is a valid typed model


async def test_second_turn_sees_the_first(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        first = await execute(client, engine.url, api_keys["main"], {"message": "my name is Ada"})
        task_id = first.headers["x-task-id"]
        second = await execute(
            client, engine.url, api_keys["main"], {"message": "who am I?", "task_id": task_id}
        )
    assert second.headers["x-task-id"] == task_id
    assert second.text == "You said: who am I? Earlier you said: my name is Ada"
    # One log per task: the second turn continues the first's numbering.
    assert second.seqs[0] == first.seqs[-1] + 1
    assert second.events[0]["turn_id"] != first.events[0]["turn_id"]
    assert second.events[0]["timestamp"] > first.events[-1]["timestamp"]


async def test_client_chosen_task_id_is_created(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client, engine.url, api_keys["main"], {"message": "hi", "task_id": "my-task.1"}
        )
    assert got.headers["x-task-id"] == "my-task.1"
    assert got.events[0]["task_id"] == "my-task.1"


@pytest.mark.parametrize("cursor", ["after_seq", "last_event_id", "after"])
async def test_resume_mid_stream_while_hot(
    engine: EngineProcesses, api_keys: dict[str, str], cursor: str
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        first = await execute(
            client,
            engine.url,
            key,
            {"message": script(text="tok ", deltas=60, delay_ms=10)},
            limit=12,
        )
        task_id = first.headers["x-task-id"]
        last = first.events[-1]
        params: dict[str, object] = {"task_id": task_id}
        headers: dict[str, str] = {}
        if cursor == "after_seq":
            params["after_seq"] = last["seq"]
        elif cursor == "last_event_id":
            headers["Last-Event-ID"] = first.ids[-1]
        else:
            params["after"] = last["timestamp"]
        rest = await replay(client, engine.url, key, params, headers=headers)
    combined = first.events + rest.events
    seqs = [e["seq"] for e in combined]
    assert seqs == list(range(1, len(seqs) + 1)), "no gap, no duplicate"
    assert combined[-1]["phase"] == "completed"
    assert "".join(e["text"] for e in combined if e["type"] == "text_delta") == "tok " * 60


async def test_replay_of_idle_task_ends_at_once(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        turn = await execute(client, engine.url, key, {"message": "done soon"})
        task_id = turn.headers["x-task-id"]
        everything = await replay(client, engine.url, key, {"task_id": task_id, "after": 0})
        tail = await replay(client, engine.url, key, {"task_id": task_id, "after_seq": 3})
        nothing = await replay(
            client, engine.url, key, {"task_id": task_id, "after_seq": turn.seqs[-1]}
        )
    assert everything.events == turn.events
    assert tail.events == turn.events[3:]
    assert nothing.events == []


async def test_heartbeats_flow_while_a_turn_runs(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    # The engine fixture runs with HOLDFAST_HEARTBEAT_SECONDS=1. Raw frames,
    # so we see exactly which lines each event has.
    body = {"message": script(text="slow ", deltas=6, delay_ms=500)}
    frames: list[list[str]] = []
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream(
            "POST",
            f"{engine.url}/execute",
            json=body,
            headers={"X-Engine-Key": api_keys["main"]},
        ) as response:
            current: list[str] = []
            async for line in response.aiter_lines():
                if line:
                    current.append(line)
                elif current:
                    frames.append(current)
                    current = []
    beats = [f for f in frames if f[0] == "event: heartbeat"]
    assert len(beats) >= 2
    for beat in beats:
        assert not any(line.startswith("id:") for line in beat), "heartbeats carry no id"
        data = json.loads(beat[-1].removeprefix("data: "))
        assert data["type"] == "heartbeat" and "seq" not in data
        assert isinstance(data["timestamp"], int)
    logged = [f for f in frames if f[0] != "event: heartbeat"]
    assert all(f[1].startswith("id: ") for f in logged)
    assert json.loads(logged[-1][-1].removeprefix("data: "))["phase"] == "completed"


async def test_messages_are_stored(
    engine: EngineProcesses, api_keys: dict[str, str], sessions
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(client, engine.url, api_keys["main"], {"message": "store me"})
    task_id = await engine_task_id(sessions, got.headers["x-task-id"])
    async with sessions() as session:
        rows = (
            await session.execute(
                select(Message.role, Message.content)
                .where(Message.task_id == task_id)
                .order_by(Message.id)
            )
        ).all()
    assert [r.role for r in rows] == ["user", "assistant"]
    assert rows[0].content["blocks"] == [{"type": "text", "text": "store me"}]
    assert rows[1].content["blocks"][0]["text"] == "You said: store me"
    async with sessions() as session:
        assert await session.scalar(select(func.count()).select_from(Message)) >= 2


async def test_stream_failure_after_output_leaves_a_consistent_view(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=30) as client:
        broken = await execute(
            client, engine.url, key, {"message": script(text="partial ", deltas=3, fail="boom")}
        )
        task_id = broken.headers["x-task-id"]
        after = await execute(
            client, engine.url, key, {"message": "still there?", "task_id": task_id}
        )
    # Each attempt but the last is taken back (its block closed, then
    # turn_resumed names its events to discard) and the call made again; the
    # last attempt's block is closed, then the error, then errored: the text
    # it showed stays, once.
    attempt = ["content_block_start", "text_delta", "text_delta", "text_delta"]
    attempt += ["content_block_stop"]
    retried = [*attempt, "turn_resumed"] * 3
    assert broken.types == [
        "thread_lifecycle",
        *retried,
        *attempt,
        "usage",
        "error",
        "thread_lifecycle",
    ]
    marks = [e for e in broken.events if e["type"] == "turn_resumed"]
    assert [(m["reason"], m["discard_to_seq"] - m["discard_from_seq"]) for m in marks] == [
        ("model_retry", 4)
    ] * 3
    assert visible_text(broken.events) == "partial " * 3
    error = broken.events[-2]
    assert error["error"] == "LLM_PROVIDER_ERROR"
    assert error["details"]["partial_output"] is True
    assert broken.events[-1]["phase"] == "errored"
    assert_gapless(broken)
    # The task takes its next message.
    assert after.events[-1]["phase"] == "completed"
    assert after.text.startswith("You said: still there?")


async def test_model_no_worker_serves_is_422(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=engine.url) as client:
        response = await client.post(
            "/execute",
            json={"message": "hi", "model": "gemini:gemini-2.5-pro"},
            headers={"X-Engine-Key": api_keys["main"]},
        )
        scripted = await client.post(
            "/execute",
            json={"message": "hi", "model": "scripted"},
            headers={"X-Engine-Key": api_keys["main"]},
        )
        await scripted.aread()
    assert response.status_code == 422
    assert response.json()["error"] == "MODEL_UNAVAILABLE"
    assert scripted.status_code == 200
