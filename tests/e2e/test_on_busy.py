"""Double-texting: ``on_busy`` on ``POST /execute`` against a running turn.

Each mode is driven by two clients racing (``asyncio.gather``) against a turn
the scripted provider makes slow; every test then reads the task's whole log
back and checks that no two turns of the task ran at once, and that no
message was lost.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from holdfast_loop_worker.stopping import TurnStop
from holdfast_shared.db.models import Message, Turn
from holdfast_shared.ids import new_id
from holdfast_shared.keys import Keys
from holdfast_shared.turnqueue import PENDING, STEERING, WAITING
from httpx_sse import aconnect_sse
from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.processes import EngineProcesses
from tests.sse_client import Received, execute, replay
from tests.taskids import engine_task_id

pytestmark = pytest.mark.timeout(90)

Sessions = async_sessionmaker[AsyncSession]


def script(**kw: object) -> str:
    return "/script " + json.dumps(kw)


# One model call of about 3 s (long enough for the racing requests to land
# inside it on a loaded machine).
SLOW = script(text="w ", deltas=60, delay_ms=50)
# A model call of about 3 s, a tool call (run by the loop itself), then a
# second model call: an iteration boundary a steer can join at.
SLOW_THEN_TOOL = script(
    text="w ",
    deltas=60,
    delay_ms=50,
    tool_calls=[{"name": "working_memory", "input": {"action": "set", "key": "k", "value": "v"}}],
)
ASK = script(tool_calls=[{"name": "ask_user", "input": {"question": "Which one?"}}])


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


class Live:
    """An ``/execute`` response read in the background, inspectable while it streams."""

    def __init__(self) -> None:
        self.got: asyncio.Future[Received] = asyncio.get_running_loop().create_future()
        self.events: list[dict[str, Any]] = []
        self.task: asyncio.Task[Received] | None = None
        self.arrived = asyncio.Event()

    @classmethod
    async def open(
        cls, client: httpx.AsyncClient, base: str, key: str, body: dict[str, Any]
    ) -> tuple[Live, Received]:
        """Send the request; returns once the response's status and headers are in."""
        live = cls()
        live.task = asyncio.create_task(live._read(client, base, key, body))
        head = await asyncio.wait_for(asyncio.shield(live.got), 30)
        return live, head

    async def _read(
        self, client: httpx.AsyncClient, base: str, key: str, body: dict[str, Any]
    ) -> Received:
        headers = {"X-Engine-Key": key}
        async with aconnect_sse(
            client, "POST", f"{base}/execute", headers=headers, json=body
        ) as source:
            response = source.response
            got = Received(response.status_code, response.headers, events=self.events)
            self.got.set_result(got)
            if response.status_code != 200:
                await response.aread()
                got.body = response.json()
                return got
            async for sse in source.aiter_sse():
                data = json.loads(sse.data)
                if sse.event == "heartbeat":
                    got.heartbeats.append(data)
                else:
                    self.events.append(data)
                    self.arrived.set()
                    got.ids.append(sse.id)
            return got

    async def until(self, check: Callable[[dict[str, Any]], bool]) -> None:
        """Wait (up to 20 s) for an event that passes ``check``."""
        async with asyncio.timeout(20):
            while not any(check(e) for e in self.events):
                self.arrived.clear()
                await self.arrived.wait()

    async def result(self) -> Received:
        assert self.task is not None
        return await asyncio.wait_for(self.task, 60)


def is_delta(event: dict[str, Any]) -> bool:
    return bool(event["type"] == "text_delta")


def terminal(event: dict[str, Any]) -> bool:
    return bool(event["type"] == "thread_lifecycle" and event["phase"] in ("completed", "errored"))


def turns_in_order(log: Received) -> list[str]:
    """The task's turns in the order they ran; fails if two ever overlapped."""
    order: list[str] = []
    running: str | None = None
    for event in log.events:
        turn = event["turn_id"]
        if event["type"] == "thread_lifecycle" and event["phase"] == "started":
            assert running is None, f"turn {turn} started while {running} ran"
            running = turn
            order.append(turn)
        else:
            assert turn == running, f"an event of {turn} while {running} ran"
        if terminal(event):
            running = None
    assert running is None, "the last turn never ended"
    return order


async def whole_log(
    client: httpx.AsyncClient, engine: EngineProcesses, key: str, task: str
) -> Received:
    got = await replay(client, engine.url, key, {"task_id": task, "after": 0})
    assert got.seqs == list(range(1, len(got.seqs) + 1))
    return got


def assert_ran_alone(got: Received) -> None:
    """A response that streams exactly one turn from its start to its end."""
    assert got.status == 200, got.body
    assert got.events[0]["type"] == "thread_lifecycle" and got.events[0]["phase"] == "started"
    assert got.events[0]["turn_id"] == got.headers["x-turn-id"]
    assert terminal(got.events[-1]) and got.events[-1]["turn_id"] == got.headers["x-turn-id"]


async def test_unknown_mode_is_422_and_writes_nothing(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    task = unique("busy-422")
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{engine.url}/execute",
            headers={"X-Engine-Key": api_keys["main"]},
            json={"message": "hi", "task_id": task, "on_busy": "later"},
        )
        # An edit or a retry forks the conversation: it cannot wait for a turn.
        forked = await client.post(
            f"{engine.url}/execute",
            headers={"X-Engine-Key": api_keys["main"]},
            json={"message": "hi", "task_id": task, "edit_message_id": 1, "on_busy": "enqueue"},
        )
    for got in (response, forked):
        assert got.status_code == 422
        body = got.json()
        assert body["error"] == "INVALID_REQUEST"
        assert [e["loc"] for e in body["details"]["errors"]] == [["body", "on_busy"]]
    with pytest.raises(AssertionError):
        await engine_task_id(sessions, task)


async def test_a_mode_on_an_idle_task_is_an_ordinary_turn(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        got = await execute(
            client, engine.url, api_keys["main"], {"message": "hello", "on_busy": "enqueue"}
        )
    assert_ran_alone(got)
    assert got.headers["x-queued"] == "no"
    assert got.text == "You said: hello"


async def test_enqueue_two_racing_clients_both_run_after_the_turn(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key, task = api_keys["main"], unique("busy-enqueue")
    async with httpx.AsyncClient(timeout=60) as client:
        first, _ = await Live.open(client, engine.url, key, {"message": SLOW, "task_id": task})
        await first.until(is_delta)
        a, b = await asyncio.gather(
            *(
                execute(
                    client,
                    engine.url,
                    key,
                    {"message": text, "task_id": task, "on_busy": "enqueue"},
                )
                for text in ("one", "two")
            )
        )
        running = await first.result()
        log = await whole_log(client, engine, key, task)
    assert running.events[-1]["stop_reason"] == "end_turn"
    for got in (a, b):
        assert_ran_alone(got)
        assert got.headers["x-queued"] == "enqueue"
        # Each waited for the turn before it: it saw the message before its own.
        assert got.events[0]["seq"] > running.events[-1]["seq"]
    order = turns_in_order(log)
    assert order[0] == running.events[0]["turn_id"]
    earlier, later = sorted((a, b), key=lambda g: g.events[0]["seq"])
    assert order[1:] == [earlier.headers["x-turn-id"], later.headers["x-turn-id"]]
    first_text = "one" if earlier is a else "two"
    second_text = "two" if earlier is a else "one"
    assert earlier.text.startswith(f"You said: {first_text} Earlier you said: /script")
    assert later.text == f"You said: {second_text} Earlier you said: {first_text}"


async def test_enqueued_messages_keep_their_order(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key, task = api_keys["main"], unique("busy-fifo")
    async with httpx.AsyncClient(timeout=60) as client:
        first, _ = await Live.open(client, engine.url, key, {"message": SLOW, "task_id": task})
        await first.until(is_delta)
        queued = []
        for text in ("m1", "m2", "m3"):  # each acknowledged before the next is sent
            live, head = await Live.open(
                client, engine.url, key, {"message": text, "task_id": task, "on_busy": "enqueue"}
            )
            assert head.status == 200 and head.headers["x-queued"] == "enqueue"
            queued.append(live)
        results = [await live.result() for live in queued]
        log = await whole_log(client, engine, key, task)
    order = turns_in_order(log)
    assert order[1:] == [got.headers["x-turn-id"] for got in results]
    assert [got.text for got in results[1:]] == [
        "You said: m2 Earlier you said: m1",
        "You said: m3 Earlier you said: m2",
    ]


async def test_interrupt_two_racing_clients_cancel_the_turn_and_keep_its_output(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    key, task = api_keys["main"], unique("busy-interrupt")
    async with httpx.AsyncClient(timeout=60) as client:
        first, _ = await Live.open(client, engine.url, key, {"message": SLOW, "task_id": task})
        await first.until(lambda e: is_delta(e) and e["seq"] > 4)
        a, b = await asyncio.gather(
            *(
                execute(
                    client,
                    engine.url,
                    key,
                    {"message": text, "task_id": task, "on_busy": "interrupt"},
                )
                for text in ("stop", "halt")
            )
        )
        cut = await first.result()
        log = await whole_log(client, engine, key, task)
    assert cut.events[-1]["phase"] == "completed"
    assert cut.events[-1]["stop_reason"] == "cancelled"
    partial = cut.text
    assert partial and len(partial) < len("w " * 60)
    for got in (a, b):
        assert_ran_alone(got)
        assert got.headers["x-queued"] == "interrupt"
    order = turns_in_order(log)
    earlier, later = sorted((a, b), key=lambda g: g.events[0]["seq"])
    assert order == [
        cut.events[0]["turn_id"],
        earlier.headers["x-turn-id"],
        later.headers["x-turn-id"],
    ]
    # The first starts as soon as the cancelled turn ended.
    assert earlier.events[0]["seq"] == cut.events[-1]["seq"] + 1
    # The later one may have interrupted the earlier in turn; it ends normally.
    assert later.events[-1]["stop_reason"] == "end_turn"
    # The cancelled turn's partial answer is part of the conversation.
    async with sessions() as session:
        stored = (
            await session.execute(
                select(Message.role, Message.content)
                .where(Message.turn_id == cut.events[0]["turn_id"])
                .order_by(Message.position)
            )
        ).all()
    assert [role for role, _ in stored] == ["user", "assistant"]
    assert stored[1][1]["interrupted"] is True
    assert stored[1][1]["blocks"][0]["text"].startswith(partial.strip())


async def test_steer_two_racing_clients_join_the_running_turn(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    key, task = api_keys["main"], unique("busy-steer")
    async with httpx.AsyncClient(timeout=60) as client:
        first, _ = await Live.open(
            client, engine.url, key, {"message": SLOW_THEN_TOOL, "task_id": task}
        )
        await first.until(is_delta)
        a, b = await asyncio.gather(
            *(
                execute(
                    client, engine.url, key, {"message": text, "task_id": task, "on_busy": "steer"}
                )
                for text in ("steer-one", "steer-two")
            )
        )
        running = await first.result()
        log = await whole_log(client, engine, key, task)
    turn_id = running.events[0]["turn_id"]
    assert turns_in_order(log) == [turn_id], "the steers started no turn of their own"
    joined = [e for e in running.events if e["type"] == "user_message"]
    assert [e["message_id"] for e in joined] == sorted(
        (a.headers["x-turn-id"], b.headers["x-turn-id"]),
        key=lambda m: [e["message_id"] for e in joined].index(m),
    )
    assert {e["text"] for e in joined} == {"steer-one", "steer-two"}
    assert all(e["steer"] and e["applied"] == "current_turn" for e in joined)
    for got in (a, b):
        assert got.status == 200 and got.headers["x-queued"] == "steer"
        # Each streams the running turn from its own message on, to its end.
        assert got.events[0]["type"] == "user_message"
        assert got.events[0]["message_id"] == got.headers["x-turn-id"]
        assert got.events[0]["turn_id"] == turn_id
        assert got.events[-1] == running.events[-1]
    # They came in after the tool's result, before the next model call, which saw them.
    types = running.types
    assert types.index("tool_result") < types.index("user_message")
    after = running.events[types.index("user_message") :]
    said = "".join(e["text"] for e in after if e["type"] == "text_delta")
    assert said == f"You said: {joined[1]['text']} Earlier you said: {joined[0]['text']}"
    assert running.events[-1]["stop_reason"] == "end_turn"
    async with sessions() as session:
        rows = (
            await session.execute(
                select(Message.role, Message.content)
                .where(Message.turn_id == turn_id)
                .order_by(Message.position)
            )
        ).all()
        leftover = await session.scalar(
            select(func.count())
            .select_from(Turn)
            .where(Turn.id.in_([a.headers["x-turn-id"], b.headers["x-turn-id"]]))
        )
    texts = [c["blocks"][0].get("text") for role, c in rows if role == "user"]
    assert texts[-2:] == [joined[0]["text"], joined[1]["text"]]
    assert leftover == 0


async def test_a_steer_the_turn_cannot_take_runs_as_the_next_turn(
    engine: EngineProcesses, api_keys: dict[str, str]
) -> None:
    key, task = api_keys["main"], unique("busy-late-steer")
    async with httpx.AsyncClient(timeout=60) as client:
        first, _ = await Live.open(client, engine.url, key, {"message": SLOW, "task_id": task})
        await first.until(is_delta)  # its only model call is under way: no boundary left
        got = await execute(
            client, engine.url, key, {"message": "late", "task_id": task, "on_busy": "steer"}
        )
        running = await first.result()
        log = await whole_log(client, engine, key, task)
    assert_ran_alone(got)
    note = got.events[1]
    assert note["type"] == "user_message" and note["applied"] == "next_turn"
    assert note["message_id"] == got.headers["x-turn-id"] and note["text"] == "late"
    assert got.text.startswith("You said: late Earlier you said: /script")
    assert turns_in_order(log) == [running.events[0]["turn_id"], got.headers["x-turn-id"]]


async def test_a_parked_turn_takes_a_steer_when_answered_and_is_ended_by_an_interrupt(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    steered, interrupted = unique("busy-parked-steer"), unique("busy-parked-interrupt")
    async with httpx.AsyncClient(timeout=60) as client:

        async def park(task: str) -> tuple[Live, dict[str, Any]]:
            live, _ = await Live.open(client, engine.url, key, {"message": ASK, "task_id": task})
            await live.until(lambda e: e["type"] == "hitl_request")
            return live, next(e for e in live.events if e["type"] == "hitl_request")

        # steer: waits with the turn, joins it once the question is answered.
        turn, question = await park(steered)
        steer, head = await Live.open(
            client,
            engine.url,
            key,
            {"message": "use the blue one", "task_id": steered, "on_busy": "steer"},
        )
        assert head.status == 200
        # The gateway committed the steer and looked for a turn to start before
        # it answered: the steer waits, stored, beside a turn still parked.
        async with sessions() as session:
            statuses = dict(
                (
                    await session.execute(
                        select(Turn.id, Turn.status).where(
                            Turn.id.in_([question["turn_id"], head.headers["x-turn-id"]])
                        )
                    )
                ).all()
            )
        assert statuses == {question["turn_id"]: "parked", head.headers["x-turn-id"]: STEERING}
        assert steer.events == [], "nothing joins a turn that waits for an answer"
        answered = await client.post(
            f"{engine.url}/hitl/respond",
            headers=headers,
            json={"task_id": steered, "request_id": question["request_id"], "answer": "blue"},
        )
        assert answered.status_code == 200, answered.text
        got = await steer.result()
        parked = await turn.result()
        assert got.events[0]["type"] == "user_message"
        assert got.events[0]["turn_id"] == parked.events[0]["turn_id"]
        assert got.text.startswith("You said: use the blue one")
        assert parked.events[-1]["stop_reason"] == "end_turn"

        # interrupt: closes the question, cancels the turn, runs the message.
        turn, question = await park(interrupted)
        now = await execute(
            client,
            engine.url,
            key,
            {"message": "never mind", "task_id": interrupted, "on_busy": "interrupt"},
        )
        parked = await turn.result()
        pending = await client.get(
            f"{engine.url}/hitl/pending", headers=headers, params={"task_id": interrupted}
        )
        log = await whole_log(client, engine, key, interrupted)
    assert parked.events[-1]["stop_reason"] == "cancelled"
    assert pending.json()["pending"] == []
    assert_ran_alone(now)
    assert now.text.startswith("You said: never mind")
    assert turns_in_order(log) == [parked.events[0]["turn_id"], now.headers["x-turn-id"]]


async def test_the_queue_is_bounded_per_task(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    key, task = api_keys["main"], unique("busy-full")
    limit = 8  # HOLDFAST_MAX_QUEUED_TURNS's default
    async with httpx.AsyncClient(timeout=60) as client:
        first, _ = await Live.open(
            client,
            engine.url,
            key,
            {"message": script(text="w ", deltas=100, delay_ms=50), "task_id": task},
        )
        await first.until(is_delta)
        opened = await asyncio.gather(
            *(
                Live.open(
                    client,
                    engine.url,
                    key,
                    {"message": f"q{i}", "task_id": task, "on_busy": "enqueue"},
                )
                for i in range(limit)
            )
        )
        assert all(head.status == 200 for _live, head in opened)
        refused = await client.post(
            f"{engine.url}/execute",
            headers={"X-Engine-Key": key},
            json={"message": "one too many", "task_id": task, "on_busy": "steer"},
        )
        engine_id = await engine_task_id(sessions, task)
        async with sessions() as session:
            waiting = await session.scalar(
                select(func.count())
                .select_from(Turn)
                .where(Turn.task_id == engine_id, Turn.status.in_(PENDING))
            )
        cancel = await client.post(
            f"{engine.url}/execute/cancel", headers={"X-Engine-Key": key}, json={"task_id": task}
        )
        assert cancel.status_code == 200
        results = [await live.result() for live, _head in opened]
        log = await whole_log(client, engine, key, task)
    assert refused.status_code == 409
    assert refused.json()["error"] == "TURN_QUEUE_FULL"
    assert refused.json()["details"]["limit"] == limit
    assert waiting == limit, "the refused message was not stored"
    assert len(turns_in_order(log)) == 1 + limit
    assert sorted(got.text.split(" Earlier")[0] for got in results) == sorted(
        f"You said: q{i}" for i in range(limit)
    )


async def test_a_queue_left_behind_by_a_dead_worker_is_started_by_the_sweep(
    engine: EngineProcesses,
    api_keys: dict[str, str],
    sessions: Sessions,
    redis: Redis,
    redis_prefix: str,
) -> None:
    """A worker that died after ending a turn, before starting the next: the
    message waits in PostgreSQL, and even holds the lock (it died mid-promotion)."""
    key, task = api_keys["main"], unique("busy-stranded")
    async with httpx.AsyncClient(timeout=60) as client:
        done = await execute(client, engine.url, key, {"message": "first", "task_id": task})
        assert done.status == 200
        engine_id = await engine_task_id(sessions, task)
        stranded = new_id("turn")
        async with sessions.begin() as session:
            session.add(Turn(id=stranded, task_id=engine_id, status=WAITING))
            await session.flush()
            content = {"blocks": [{"type": "text", "text": "left behind"}]}
            session.add(
                Message(
                    task_id=engine_id, turn_id=stranded, position=0, role="user", content=content
                )
            )
        await redis.set(Keys(redis_prefix).running_turn(engine_id), stranded, ex=600)
        status = None
        for _ in range(600):  # the sweep runs every HOLDFAST_LEASE_SECONDS (10 s); slow under load
            async with sessions() as session:
                status = await session.scalar(select(Turn.status).where(Turn.id == stranded))
            if status == "completed":
                break
            await asyncio.sleep(0.1)
        log = await whole_log(client, engine, key, task)
    assert status == "completed"
    assert turns_in_order(log)[-1] == stranded
    said = "".join(e["text"] for e in log.events if e["turn_id"] == stranded and is_delta(e))
    assert said == "You said: left behind Earlier you said: first"


async def test_a_second_stop_does_not_cut_a_stopping_turn_short() -> None:
    """Two interrupts racing both cancel the running turn: the second must not
    cancel the first's ending (storing the partial answer, the terminal event)."""
    stop = TurnStop()
    ending_steps = 0

    async def turn() -> str:
        nonlocal ending_steps
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            assert stop.consume() == "cancel"
            assert stop.request("cancel"), "acknowledged: the turn is stopping already"
            for _ in range(3):  # the ending's own awaits
                await asyncio.sleep(0.01)
                ending_steps += 1
            return "cancelled"
        return "completed"

    task = asyncio.create_task(turn())
    stop.bind(task)
    await asyncio.sleep(0)
    assert stop.request("cancel")
    assert await task == "cancelled"
    assert ending_steps == 3
