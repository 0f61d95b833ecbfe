"""``DELETE /tasks/{task_id}`` racing ``POST /execute`` on the same task.

Both serialize on the task's row: a message the engine accepts (200) is
stored and its turn runs to its end, whichever request wins; the loser gets a
409 or 404, never a 500. A POST that comes just after the delete may create a
new task of the same name — that is a new task, and its message is kept too.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Message
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from holdfast.testing import add_api_key
from tests.processes import EngineProcesses
from tests.sse_client import Received, execute

pytestmark = pytest.mark.timeout(900)

RACES = 100
# Races run this many at a time (on tasks of their own): more overlap, and a
# dropped message (a stream that never ends) costs one bound per batch.
AT_ONCE = 10
# How long a stream of an accepted message may take to end: generous, since
# ten turns share two slow cores with the other engineers' suites.
STREAM_BOUND_SECONDS = 60.0


@pytest.fixture(scope="module")
def key(database_url: str) -> str:
    return add_api_key(database_url, f"tenant-delrace-{secrets.token_hex(3)}")


@dataclass
class Outcome:
    race: int
    deleted: int
    posted: Received | None
    failure: str | None = None


async def _idle(client: httpx.AsyncClient, base: str, key: str, task: str) -> None:
    """Until the task's history turn has released the task (else every delete is a 409)."""
    for _ in range(1200):
        got = await client.get(f"{base}/tasks/{task}", headers={"X-Engine-Key": key})
        if got.status_code == 200 and got.json()["status"] == "idle":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"task {task} never became idle")


async def _race(
    client: httpx.AsyncClient,
    base: str,
    key: str,
    sessions: async_sessionmaker[AsyncSession],
    race: int,
) -> Outcome:
    task = f"delrace-{race}-{secrets.token_hex(3)}"
    history = await execute(client, base, key, {"message": "history", "task_id": task})
    assert history.status == 200 and history.events[-1]["phase"] == "completed", history
    await _idle(client, base, key, task)

    async def delete() -> int:
        # Jitter (not a decision): which request reaches the gateway first varies.
        await asyncio.sleep((race % 4) / 1000)
        response = await client.delete(f"{base}/tasks/{task}", headers={"X-Engine-Key": key})
        return response.status_code

    async def post() -> Received | None:
        await asyncio.sleep(((race // 4) % 3) / 1000)
        body = {"message": f"race {race}", "task_id": task}
        try:
            return await asyncio.wait_for(
                execute(client, base, key, body), timeout=STREAM_BOUND_SECONDS
            )
        except TimeoutError:
            return None

    deleted, posted = await asyncio.gather(delete(), post())
    outcome = Outcome(race, deleted, posted)
    if deleted not in (200, 404, 409):
        outcome.failure = f"DELETE answered {deleted}"
    elif posted is None:
        outcome.failure = "an accepted message's stream did not end"
    elif posted.status != 200:
        if posted.status not in (404, 409):
            outcome.failure = f"POST answered {posted.status}: {posted.body}"
    else:
        outcome.failure = await _check_accepted(sessions, posted, deleted)
    return outcome


async def _check_accepted(
    sessions: async_sessionmaker[AsyncSession], posted: Received, deleted: int
) -> str | None:
    """Why the accepted message's turn is wrong, or None when it is right."""
    if not posted.events or posted.events[0].get("phase") != "started":
        return f"a 200 without its started event: {posted.types}"
    turn_id = posted.headers["X-Turn-Id"]
    if posted.events[0]["turn_id"] != turn_id:
        return "the started event is another turn's"
    if posted.events[-1].get("phase") != "completed":
        return f"the turn did not complete: {posted.types}"
    async with sessions() as session:
        stored = await session.scalar(
            select(Message.content).where(Message.turn_id == turn_id, Message.position == 0)
        )
    # Gone only with a delete that won after the turn had ended (and released
    # the task), which took its history with it.
    if stored is None and deleted != 200:
        return "the accepted message is not stored"
    return None


async def test_delete_racing_execute_never_drops_an_accepted_message(
    engine: EngineProcesses, key: str, sessions: async_sessionmaker[AsyncSession]
) -> None:
    outcomes: list[Outcome] = []
    async with httpx.AsyncClient(timeout=STREAM_BOUND_SECONDS) as client:
        for first in range(0, RACES, AT_ONCE):
            outcomes += await asyncio.gather(
                *(
                    _race(client, engine.url, key, sessions, race)
                    for race in range(first, first + AT_ONCE)
                )
            )
    failures = [(o.race, o.failure) for o in outcomes if o.failure is not None]
    tally: dict[str, Any] = {}
    for o in outcomes:
        posted = None if o.posted is None else o.posted.status
        tally[f"DELETE {o.deleted} / POST {posted}"] = (
            tally.get(f"DELETE {o.deleted} / POST {posted}", 0) + 1
        )
    print(f"outcomes: {tally}; failures: {len(failures)}")
    assert not failures, f"{len(failures)} of {RACES} races went wrong: {failures[:10]}; {tally}"
