"""``Idempotency-Key`` on ``POST /execute``: a message sent again runs once.

The chaos soak's finding (#29): a POST the client gave up on while its gateway
stalled started its turn after the client had sent the message again, so one
message ran as two turns. With a key, every request after the first streams
the first one's turn, whichever of them committed first.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid

import httpx
import pytest
from holdfast_gateway.executekeys import fingerprint
from holdfast_gateway.routes.execute import ExecuteRequest
from holdfast_shared.db.models import ExecuteKey, Task, Turn
from holdfast_shared.ids import new_id
from sqlalchemy import delete, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tests.processes import EngineProcesses
from tests.sse_client import Received, execute, replay
from tests.taskids import TENANTS, engine_task_id

pytestmark = pytest.mark.timeout(90)

Sessions = async_sessionmaker[AsyncSession]
# About 1.5 s of answer: requests sent meanwhile meet a turn still running.
SLOW = "/script " + json.dumps({"text": "w ", "deltas": 30, "delay_ms": 50})


def _task() -> str:
    return f"idem-{secrets.token_hex(4)}"


async def _send(
    client: httpx.AsyncClient, engine: EngineProcesses, key: str, body: dict[str, object], idem: str
) -> Received:
    return await execute(client, engine.url, key, body, headers={"Idempotency-Key": idem})


async def _turns(sessions: Sessions, task: str) -> int:
    task_id = await engine_task_id(sessions, task)
    async with sessions() as session:
        count = await session.scalar(select(func.count()).where(Turn.task_id == task_id))
    return int(count or 0)


def _one_turn(got: Received) -> str:
    assert got.status == 200, got.body
    started, end = got.events[0], got.events[-1]
    assert (started["type"], started["phase"]) == ("thread_lifecycle", "started")
    assert (end["type"], end["phase"]) == ("thread_lifecycle", "completed")
    assert {e["turn_id"] for e in got.events} == {got.headers["x-turn-id"]}
    return str(got.headers["x-turn-id"])


async def test_a_message_sent_again_streams_the_first_turn(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    key, task, idem = api_keys["main"], _task(), str(uuid.uuid4())
    body = {"message": SLOW, "task_id": task}
    async with httpx.AsyncClient(timeout=60) as client:
        # The first response is lost after a few events (the client hung up).
        cut = await execute(
            client, engine.url, key, body, headers={"Idempotency-Key": idem}, limit=3
        )
        again = await _send(client, engine, key, body, idem)
        # The body's fields in another order are the same request.
        reordered = await _send(client, engine, key, {"task_id": task, "message": SLOW}, idem)
        log = await replay(client, engine.url, key, {"task_id": task, "after": 0})
    turn = _one_turn(again)
    assert cut.headers["x-turn-id"] == turn and "idempotent-replayed" not in cut.headers
    assert again.headers["idempotent-replayed"] == "true"
    assert again.events[: len(cut.events)] == cut.events
    assert _one_turn(reordered) == turn and reordered.events == again.events
    assert log.events == again.events
    assert await _turns(sessions, task) == 1


async def test_racing_requests_with_one_key_start_one_turn(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    key, task, idem = api_keys["main"], _task(), str(uuid.uuid4())
    body = {"message": SLOW, "task_id": task}
    async with httpx.AsyncClient(timeout=60) as client:
        got = await asyncio.gather(*(_send(client, engine, key, body, idem) for _ in range(4)))
    turns = {_one_turn(g) for g in got}
    assert len(turns) == 1
    assert [g.headers.get("idempotent-replayed") for g in got].count(None) == 1
    assert all(g.events == got[0].events for g in got)
    assert await _turns(sessions, task) == 1


async def test_a_waiting_message_sent_again_waits_once(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    """``on_busy: enqueue``: the key is recorded with the waiting message."""
    key, task, idem = api_keys["main"], _task(), str(uuid.uuid4())
    queued = {"message": "after", "task_id": task, "on_busy": "enqueue"}
    async with httpx.AsyncClient(timeout=60) as client:
        running = asyncio.create_task(
            execute(client, engine.url, key, {"message": SLOW, "task_id": task}, limit=2)
        )
        await running  # the slow turn has started
        first, second = await asyncio.gather(
            _send(client, engine, key, queued, idem), _send(client, engine, key, queued, idem)
        )
    assert _one_turn(first) == _one_turn(second)
    assert first.text == second.text and first.text.startswith("You said: after")
    assert await _turns(sessions, task) == 2


async def test_a_waiting_message_and_a_starting_one_take_their_locks_in_one_order(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    """A CI run's deadlock (503 ``OperationalError``): a keyed request trying to
    start its turn holds the task's row and then records the key; one storing
    the message to wait recorded the key and then waited for the task's row.
    Here a transaction of ours stands for the first, holding the task's row
    while the waiting message's request comes, then recording the key."""
    key, task, idem = api_keys["main"], _task(), str(uuid.uuid4())
    queued = {"message": "after", "task_id": task, "on_busy": "enqueue"}
    async with httpx.AsyncClient(timeout=60) as client:
        running = await execute(
            client, engine.url, key, {"message": SLOW, "task_id": task}, limit=2
        )
        # A message already waiting: the keyed one below is stored at once,
        # without trying to start first.
        ahead = {"message": "ahead", "task_id": task, "on_busy": "enqueue"}
        async with client.stream(
            "POST", f"{engine.url}/execute", headers={"X-Engine-Key": key}, json=ahead
        ) as waiting:
            assert waiting.headers["x-queued"] == "enqueue"
        task_id = await engine_task_id(sessions, task)
        async with sessions() as held:
            pid = await held.scalar(select(func.pg_backend_pid()))
            await held.execute(text("SET LOCAL lock_timeout = '20s'"))
            # The lock lock_task takes.
            tenant = await held.scalar(
                select(Task.tenant_id).where(Task.id == task_id).with_for_update(key_share=True)
            )
            sent = asyncio.create_task(_send(client, engine, key, queued, idem))
            while not await _blocked_by(sessions, pid):
                assert not sent.done(), sent.result()
                await asyncio.sleep(0.02)
            # What start_turn does next with the task's row held: its claim.
            await held.execute(
                insert(ExecuteKey).values(
                    tenant_id=tenant,
                    key=idem,
                    fingerprint="0" * 64,
                    turn_id=running.headers["x-turn-id"],
                    after_seq=0,
                )
            )
            await held.rollback()
        got = await sent
    _one_turn(got)
    assert got.text.startswith("You said: after")


async def _blocked_by(sessions: Sessions, pid: int) -> bool:
    """Whether a gateway's ``lock_task`` waits for the task's row ``pid`` holds."""
    async with sessions() as session:
        waiting = await session.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"
                " AND query LIKE '%FOR NO KEY UPDATE%'"
            ),
            {"pid": pid},
        )
    return bool(waiting)


async def test_a_key_with_another_request_is_refused_and_writes_nothing(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    key, task, idem = api_keys["main"], _task(), str(uuid.uuid4())
    async with httpx.AsyncClient(timeout=60) as client:
        first = await _send(client, engine, key, {"message": "one", "task_id": task}, idem)
        other = await _send(client, engine, key, {"message": "two", "task_id": task}, idem)
        # Another tenant's key space is its own.
        theirs = await _send(client, engine, api_keys["other"], {"message": "two"}, idem)
        bad = [
            await client.post(
                f"{engine.url}/execute",
                headers={"X-Engine-Key": key, "Idempotency-Key": value},
                json={"message": "three", "task_id": task},
            )
            for value in ("has space", "x" * 256)
        ]
    _one_turn(first)
    assert other.status == 422 and other.body["error"] == "IDEMPOTENCY_KEY_REUSED", other.body
    assert other.body["details"]["turn_id"] == first.headers["x-turn-id"]
    _one_turn(theirs)
    for response in bad:
        assert response.status_code == 422, response.text
        assert response.json()["error"] == "INVALID_REQUEST"
    assert await _turns(sessions, task) == 1
    async with sessions() as session:
        keys = await session.scalar(select(func.count()).where(ExecuteKey.key == idem))
    assert keys == 2  # one per tenant


async def test_a_key_whose_turn_never_started_is_503_until_it_is_taken_back(
    engine: EngineProcesses, api_keys: dict[str, str], sessions: Sessions
) -> None:
    """What a gateway stalled between its commit and its ``started`` leaves: the
    turn and its key committed, nothing logged. A repeat is told to come back
    (503, ``Retry-After``) instead of following a turn that may never come; once
    the stale-turn sweep took the turn back (and the key with it), it runs."""
    key, task, idem = api_keys["main"], _task(), str(uuid.uuid4())
    body = {"message": "hello", "task_id": task}
    async with httpx.AsyncClient(timeout=60) as client:
        _one_turn(await execute(client, engine.url, key, {"message": "first", "task_id": task}))
        task_id = await engine_task_id(sessions, task)
        stalled = new_id("turn")
        async with sessions.begin() as session:
            session.add(Turn(id=stalled, task_id=task_id, status="queued"))
            await session.flush()
            session.add(
                ExecuteKey(
                    tenant_id=TENANTS["main"],
                    key=idem,
                    fingerprint=fingerprint(ExecuteRequest.model_validate(body)),
                    turn_id=stalled,
                    after_seq=0,
                )
            )
        starting = await _send(client, engine, key, body, idem)
        assert starting.status == 503, starting.body
        assert starting.body["details"]["turn_id"] == stalled
        assert starting.headers["retry-after"] == "1"
        async with sessions.begin() as session:  # the sweep takes it back
            await session.execute(delete(Turn).where(Turn.id == stalled))
        runs = await _send(client, engine, key, body, idem)
    assert _one_turn(runs) != stalled and runs.text.startswith("You said: hello")
