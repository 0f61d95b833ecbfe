"""The Python SDK (clients/python) against a real engine, also through a connection cutter."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
from importlib import metadata
from urllib.parse import urlsplit

import httpx
import pytest
from holdfast_client import (
    AsyncClient,
    Client,
    Event,
    HitlRequest,
    HoldfastError,
    Reconnect,
    TextDelta,
    ThreadLifecycle,
    ToolResult,
    TurnResumed,
    TurnText,
    UnknownEvent,
    parse_event,
)
from holdfast_client._resume import Resumer
from holdfast_client._sse import FrameDecoder
from httpx_sse import ServerSentEvent

from tests.client.proxy import CuttingProxy
from tests.processes import EngineProcesses

# Generous: the session engine may be started by these tests on a loaded machine.
pytestmark = pytest.mark.timeout(180)

FAST = Reconnect(delay=0.01, max_delay=0.2, max_attempts=30)
# A long turn: hundreds of deltas, streamed over about a second.
LONG_TURN = "/script " + json.dumps({"text": "tok ", "deltas": 400, "delay_ms": 3})


def script(**kw: object) -> str:
    return "/script " + json.dumps(kw)


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None
    return port


def assert_one_turn(events: list[Event]) -> None:
    """Every event once, in order, from the turn's start to its end."""
    seqs = [e.seq for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    first, last = events[0], events[-1]
    assert isinstance(first, ThreadLifecycle) and first.phase == "started"
    assert isinstance(last, ThreadLifecycle) and last.phase == "completed"
    assert {e.turn_id for e in events} == {first.turn_id}


def logged(url: str, key: str, task_id: str) -> list[Event]:
    """The task's whole log, read straight from the gateway in one connection."""
    with Client(url, key) as client:
        return list(client.replay(task_id))


# -- without an engine -------------------------------------------------------------------


def test_the_sdk_needs_none_of_the_server_packages() -> None:
    requires = metadata.requires("holdfast-client") or []
    names = {r.split(">")[0].split("=")[0].split("[")[0].split(";")[0].strip() for r in requires}
    assert names == {"httpx", "pydantic"}  # SSE is decoded by _sse.py, not httpx-sse
    code = (
        "import sys, holdfast_client, holdfast_client.client\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'holdfast', 'holdfast_shared', 'holdfast_gateway', 'holdfast_loop_worker', "
        "'holdfast_tool_runner', 'holdfast_learning', 'redis', 'sqlalchemy', 'fastapi'})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""


def test_unknown_event_types_come_through_as_generic_events() -> None:
    data = '{"type":"brand_new","task_id":"t","turn_id":"u","seq":7,"timestamp":1,"x":[1]}'
    for frame_type in ("brand_new", None):
        event = parse_event(data, frame_type)
        assert isinstance(event, UnknownEvent)
        assert (event.type, event.seq, event.model_extra) == ("brand_new", 7, {"x": [1]})
    known = parse_event('{"type":"text_delta","seq":3,"text":"hi","later_field":1}', "text_delta")
    assert isinstance(known, TextDelta) and known.text == "hi"
    with pytest.raises(ValueError):
        parse_event("[1]")


def test_turn_text_drops_the_discarded_range() -> None:
    text = TurnText()
    events: list[Event] = [
        TextDelta(seq=2, text="Hel"),
        TextDelta(seq=3, text="lo wo"),
        TurnResumed(seq=4, reason="worker_lost", discard_from_seq=2, discard_to_seq=3),
        TextDelta(seq=5, text="Hello "),
        TextDelta(seq=6, text="world"),
        TurnResumed(seq=7, reason="restart"),  # no range: nothing is taken back
    ]
    dropped = [text.feed(e) for e in events]
    assert dropped == [[], [], [2, 3], [], [], []]
    assert text.text == "Hello world" and text.discarded == {2, 3}


def test_reconnect_waits_honour_retry_and_back_off() -> None:
    r = Resumer(task_id="t", reconnect=Reconnect(delay=0.5, max_delay=3, max_attempts=4))
    assert r.request().headers == {}
    r.feed(ServerSentEvent(event="text_delta", data='{"type":"text_delta","seq":5,"text":"a"}'))
    r.feed(ServerSentEvent(retry=200))
    assert r.request().headers == {"Last-Event-ID": "5"}
    boom = httpx.RemoteProtocolError("cut")
    assert [r.lost(boom) for _ in range(4)] == [0.2, 0.4, 0.8, 1.6]
    with pytest.raises(HoldfastError) as lost:
        r.lost(boom)
    assert lost.value.code == "CONNECTION_LOST" and lost.value.details["last_seq"] == 5
    # A POST that dropped before its answer may have started a turn: it is sent
    # again with its Idempotency-Key, which the engine runs once.
    post = Resumer(body={"message": "hi"})
    first = post.request()
    assert post.lost(httpx.ReadError("gone")) == 0.5
    again = post.request()
    assert (first.method, again.method) == ("POST", "POST")
    assert first.headers == again.headers == {"Idempotency-Key": post.idempotency_key}
    assert Resumer(body={"message": "hi"}).idempotency_key != post.idempotency_key


# -- against an engine -------------------------------------------------------------------


def test_sync_stream_typed_events_and_second_turn(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    with Client(engine.url, api_keys["main"]) as client:
        turn = client.stream("hello world")
        events = list(turn)
        assert_one_turn(events)
        assert turn.task_id and turn.turn_id == events[0].turn_id
        assert turn.transcript.text == "You said: hello world"
        assert turn.last_seq == events[-1].seq
        second = client.stream("who am I?", task_id=turn.task_id)
        assert "Earlier you said: hello world" in second.until_done().text
        assert second.task_id == turn.task_id
        # replay(after=) starts after that seq: exactly the second turn.
        replayed = list(client.replay(turn.task_id, after=turn.last_seq))
        assert [e.seq for e in replayed] == list(range(turn.last_seq + 1, second.last_seq + 1))
        assert client.working_memory(turn.task_id) == {}
        assert client.delete_task(turn.task_id)["status"] == "deleted"


async def test_async_stream_and_api_methods(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with AsyncClient(engine.url, api_keys["main"]) as client:
        turn = client.stream(script(thinking="let me see", text="fine thanks"))
        events = [e async for e in turn]
        assert_one_turn(events)
        assert turn.transcript.thinking == "let me see" and turn.transcript.text == "fine thanks"
        agents = await client.list_agents()
        assert any(a["name"] == "general" for a in agents["agents"])
        assert "skills" in await client.list_skills()
        assert "servers" in await client.list_servers()
        assert isinstance(await client.learning_status(), dict)
        assert "content" in await client.get_soul()
        assert await client.pending(turn.task_id) == []


def test_errors_carry_status_code_and_message(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    with Client(engine.url, api_keys["main"]) as client:
        with pytest.raises(HoldfastError) as missing:
            client.working_memory(f"absent-{secrets.token_hex(4)}")
        assert (missing.value.status, missing.value.code) == (404, "TASK_NOT_FOUND")
        assert missing.value.message
        with pytest.raises(HoldfastError) as bad:
            list(client.stream("hi", task_id="not a valid id!"))
        assert (bad.value.status, bad.value.code) == (422, "INVALID_REQUEST")
        assert ["body", "task_id"] in [e["loc"] for e in bad.value.details["errors"]]
        done = client.stream("hi")
        done.until_done()
        assert done.task_id is not None
        with pytest.raises(HoldfastError) as idle:
            client.cancel(done.task_id)
        assert (idle.value.status, idle.value.code) == (409, "NO_RUNNING_TURN")
    with Client(engine.url, "hf_wrong_" + secrets.token_hex(8)) as stranger:
        with pytest.raises(HoldfastError) as denied:
            stranger.list_agents()
        assert (denied.value.status, denied.value.code) == (401, "INVALID_KEY")


def test_hitl_helpers_answer_a_permission_prompt(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    message = script(text="", tool_calls=[{"name": "bash", "input": {"command": "echo sdk"}}])
    with Client(engine.url, api_keys["main"]) as client:
        turn = client.stream(message)
        seen: list[Event] = []
        for event in turn:
            seen.append(event)
            if isinstance(event, HitlRequest):
                assert turn.task_id is not None
                pending = client.pending(turn.task_id)
                assert [p.request_id for p in pending] == [event.request_id]
                assert pending[0].kind == "permission" and pending[0].tool_call
                answered = client.answer(turn.task_id, "yes", request_id=event.request_id)
                assert answered["status"] == "resumed"
        assert_one_turn(seen)
        result = next(e for e in seen if isinstance(e, ToolResult))
        assert result.error is None and result.output["stdout"] == "sdk\n"


def test_sync_stream_through_random_cuts_sees_every_event_once(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]
    with (
        CuttingProxy(port_of(engine.url), cuts=40, seed=1) as proxy,
        Client(proxy.url, key, reconnect=FAST) as client,
    ):
        turn = client.stream(LONG_TURN)
        events = list(turn)
    assert proxy.cuts_made >= 20, proxy.cuts_made
    assert_one_turn(events)
    assert turn.task_id is not None
    truth = logged(engine.url, key, turn.task_id)
    assert [e.model_dump() for e in events] == [e.model_dump() for e in truth]
    assert turn.transcript.text == "tok " * 400


async def test_async_streams_through_random_cuts_see_every_event_once(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key = api_keys["main"]

    async def one(client: AsyncClient) -> tuple[str, list[Event], str]:
        turn = client.stream(LONG_TURN)
        events = [e async for e in turn]
        assert turn.task_id is not None
        return turn.task_id, events, turn.transcript.text

    with CuttingProxy(port_of(engine.url), cuts=60, seed=2) as proxy:
        async with AsyncClient(proxy.url, key, reconnect=FAST) as client:
            results = await asyncio.gather(one(client), one(client))
    assert proxy.cuts_made >= 30, proxy.cuts_made
    for task_id, events, text in results:
        assert_one_turn(events)
        truth = await asyncio.to_thread(logged, engine.url, key, task_id)
        assert [e.model_dump() for e in events] == [e.model_dump() for e in truth]
        assert text == "tok " * 400


def test_replay_resumes_through_cuts_too(engine: EngineProcesses, api_keys: dict[str, str]) -> None:
    key = api_keys["main"]
    with Client(engine.url, key) as direct:
        turn = direct.stream(script(text="one two three four five six seven eight"))
        turn.until_done()
    assert turn.task_id is not None
    with (
        CuttingProxy(port_of(engine.url), cuts=8, max_bytes=400, seed=3) as proxy,
        Client(proxy.url, key, reconnect=FAST) as client,
    ):
        replayed = list(client.replay(turn.task_id))
    assert proxy.cuts_made >= 4
    truth = logged(engine.url, key, turn.task_id)
    assert [e.seq for e in replayed] == [e.seq for e in truth] == list(range(1, len(truth) + 1))


def test_a_post_whose_answer_was_lost_is_sent_again_and_runs_once(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    """The engine got the POST and started the turn, twice the client heard
    nothing; its third send (same Idempotency-Key) streams that one turn."""
    task = f"sdk-idem-{secrets.token_hex(4)}"
    with (
        CuttingProxy(port_of(engine.url), cuts=2, posts_before_headers=True) as proxy,
        Client(proxy.url, api_keys["main"], reconnect=Reconnect(0.05, 0.2, 5)) as client,
    ):
        turn = client.stream("only once", task_id=task)
        events = list(turn)
        assert proxy.cuts_made == 2
    with Client(engine.url, api_keys["main"]) as client:
        log = list(client.replay(task))
    started = [e for e in log if isinstance(e, ThreadLifecycle) and e.phase == "started"]
    assert len(started) == 1 and started[0].turn_id == turn.turn_id
    assert [e.seq for e in events] == [e.seq for e in log]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "You said: only once"


def test_a_stream_stops_reconnecting_when_told_to(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    # Every connection cut: the client gives up after max_attempts with the cursor it had.
    with (
        CuttingProxy(port_of(engine.url), cuts=1000, max_bytes=1, seed=4) as proxy,
        Client(proxy.url, api_keys["main"], reconnect=Reconnect(0.01, 0.02, 3)) as client,
    ):
        turn = client.stream(LONG_TURN)
        with pytest.raises(HoldfastError) as lost:
            list(turn)
        assert lost.value.code == "CONNECTION_LOST"
        assert lost.value.details["task_id"] == turn.task_id


def test_frame_decoder_follows_the_sse_rules_across_chunks() -> None:
    decoder = FrameDecoder()
    chunks = [
        b"event: a\r",  # \r\n split across chunks
        b"\nid: 1\r\ndata: x\r\n\r",
        b"\n: a comment\n\ndata: l1\ndata:l2\nretry: 50\n\n",
        b"retry: 10\r\rdata: \xc3",  # bare \r line ends; a UTF-8 character split
        b"\xa9\n\nevent: \nid: 2\ndata: z\n\n",
    ]
    frames = [f for chunk in chunks for f in decoder.feed(chunk)]
    assert [(f.event, f.data, f.id or None, f.retry) for f in frames] == [
        ("a", "x", "1", None),
        ("message", "l1\nl2", None, 50),
        ("message", "", None, 10),
        ("message", "é", None, None),
        ("message", "z", "2", None),
    ]


def test_a_steered_message_is_followed_after_a_reconnect_without_cursor() -> None:
    r = Resumer(body={"message": "also this", "on_busy": "steer"})
    post = httpx.Response(
        200,
        headers={"Content-Type": "text/event-stream", "X-Task-Id": "t", "X-Turn-Id": "msg_1"},
        request=httpx.Request("POST", "http://x/execute"),
    )
    r.opened(post)
    r.lost(httpx.ReadError("cut"))  # before any event: replay from the start
    replay = httpx.Response(
        200,
        headers={"Content-Type": "text/event-stream"},
        request=httpx.Request("GET", "http://x/execute/replay"),
    )
    r.opened(replay)

    def frame(seq: int, kind: str, **fields: object) -> ServerSentEvent:
        body = {"type": kind, "task_id": "t", "turn_id": "turn_a", "seq": seq, **fields}
        return ServerSentEvent(event=kind, data=json.dumps(body))

    got = [
        r.feed(frame(1, "thread_lifecycle", phase="started")),
        r.feed(frame(2, "text_delta", text="earlier")),
        r.feed(frame(3, "user_message", text="also this", message_id="msg_1")),
        r.feed(frame(4, "text_delta", text="ok")),
        r.feed(frame(5, "thread_lifecycle", phase="completed")),
    ]
    assert [e.seq if e else None for e in got] == [None, None, 3, 4, 5]
    assert r.done and r.turn_id == "turn_a"


def test_tasks_and_executions(engine: EngineProcesses, api_keys: dict[str, str]) -> None:
    with Client(engine.url, api_keys["main"]) as client:
        turn = client.stream("remember tasks")
        turn.until_done()
        assert turn.task_id is not None
        listed = client.list_tasks(limit=100)
        assert turn.task_id in [t.get("task_id", t.get("id")) for t in listed["tasks"]]
        assert client.get_task(turn.task_id)["last_seq"] == turn.last_seq
        messages = client.task_messages(turn.task_id)["messages"]
        assert messages[0]["role"] == "user"

        made = client.create_execution({"name": "sdk job", "input": "hello execution"})
        assert made["id"].startswith("exec_")
        assert client.get_execution(made["id"])["name"] == "sdk job"
        assert made["id"] in [e["id"] for e in client.list_executions(limit=100)["executions"]]
        for event in client.replay(made["id"]):  # an execution is a task: stream it
            if isinstance(event, ThreadLifecycle) and event.ends_turn:
                break
        saved = client.checkpoint_execution(made["id"], {"step": 2}, label="half")
        assert saved is not None
        client.delete_execution(made["id"])
        with pytest.raises(HoldfastError) as gone:
            client.get_execution(made["id"])
        assert gone.value.status == 404 and gone.value.code.endswith("NOT_FOUND")
