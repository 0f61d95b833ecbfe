"""A turn's per-iteration write as one SQL statement (``EventLog``'s ``Writes``): the
step's events and its snapshot land together, or neither does."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from holdfast_loop_worker.turn_state import Snapshots, TurnState
from holdfast_shared.db.models import ChannelStateSnapshot, EventRecord
from holdfast_shared.eventlog import EventLog, Writes
from holdfast_shared.events import TextDelta
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError


def snapshots() -> Snapshots:
    return Snapshots(None, active_ttl_seconds=60, hitl_ttl_seconds=60)  # type: ignore[arg-type]


async def stored(sessions: Any, task_id: str) -> tuple[list[int], list[dict[str, Any]]]:
    async with sessions() as session:
        seqs = await session.scalars(select(EventRecord.seq).where(EventRecord.task_id == task_id))
        states = await session.scalars(
            select(ChannelStateSnapshot.state).where(ChannelStateSnapshot.task_id == task_id)
        )
        return sorted(seqs.all()), list(states.all())


async def test_events_and_snapshot_in_one_statement(eventlog: EventLog, sessions: Any) -> None:
    t = f"task_{secrets.token_hex(6)}"
    await eventlog.append(
        t, "turn_a", [TextDelta(text="a"), TextDelta(text="b")], name=t, new_task=True
    )
    state = TurnState(stage="tools", position=3, iteration=1, last_seq=2)
    snapshot = snapshots().statement(t, "turn_a", "model_call", state.to_json())
    assert await eventlog.archive_now(t, also=Writes((snapshot,))) == 2
    seqs, states = await stored(sessions, t)
    assert seqs == [1, 2] and [s["last_seq"] for s in states] == [2]
    assert int(await eventlog.redis.get(eventlog.keys.archived(t))) == 2
    # Nothing new to archive: the writes go alone.
    again = snapshots().statement(t, "turn_a", "tool_result", state.to_json())
    assert await eventlog.archive_now(t, also=Writes((again,))) == 0
    assert len((await stored(sessions, t))[1]) == 2


async def test_a_failing_write_takes_the_events_with_it(eventlog: EventLog, sessions: Any) -> None:
    t = f"task_{secrets.token_hex(6)}"
    await eventlog.append(t, None, [TextDelta(text="a")], name=t, new_task=True)
    snapshot = snapshots().statement(t, "turn_a", "model_call", TurnState().to_json())
    broken = insert(EventRecord).values(task_id=t, seq=99, type=None, timestamp=0, data="")
    with pytest.raises(IntegrityError):
        await eventlog.archive_now(t, also=Writes((snapshot, broken)))
    assert await stored(sessions, t) == ([], [])
    assert await eventlog.redis.get(eventlog.keys.archived(t)) is None
    assert not await eventlog.redis.exists(eventlog.keys.archiving(t))  # claim given back
    assert await eventlog.archive_now(t, also=Writes((snapshot,))) == 1
