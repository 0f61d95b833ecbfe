"""The event log against real Redis and PostgreSQL: numbering, cursors, archiving."""

from __future__ import annotations

import itertools
import json
import secrets

from holdfast_shared.db.models import EventRecord
from holdfast_shared.eventlog import EventLog
from holdfast_shared.events import (
    EVENT_TYPES,
    TextDelta,
    ThreadLifecycle,
    ToolCall,
    ToolResult,
    body_json,
    ends_turn,
    envelope_json,
    heartbeat_json,
    parse_event,
    turn_of,
)
from sqlalchemy import func, select


def task() -> str:
    return f"t-{secrets.token_hex(6)}"


async def test_seq_and_timestamp_are_assigned_in_order(eventlog: EventLog) -> None:
    t = task()
    first = await eventlog.append(
        t, "turn_a", [ThreadLifecycle(phase="started")], name=t, new_task=True
    )
    more = await eventlog.append(t, "turn_a", [TextDelta(text=str(i)) for i in range(50)], name=t)
    assert first.first_seq == 1 and more.first_seq == 2 and more.last_seq == 51
    stamps = first.timestamps + more.timestamps
    # 50 events in one script call land in the same millisecond: the logical
    # clock still makes every timestamp distinct and increasing.
    assert all(b > a for a, b in itertools.pairwise(stamps))
    events = [e for page in [p async for p in eventlog.pages_after(t, 0)] for e in page]
    assert [e.seq for e in events] == list(range(1, 52))
    parsed = parse_event(events[5].data)
    assert parsed.seq == 6 and parsed.task_id == t and parsed.turn_id == "turn_a"
    assert parsed.timestamp == stamps[5]


async def test_an_append_loads_its_script_again_after_redis_lost_it(eventlog: EventLog) -> None:
    """Appends call the script by its SHA (no SCRIPT EXISTS per append); a Redis
    restarted without it, or flushed, gets it again and the append goes through once."""
    t = task()
    await eventlog.append(t, "turn_a", [ThreadLifecycle(phase="started")], name=t, new_task=True)
    await eventlog.redis.script_flush()
    again = await eventlog.append(t, "turn_a", [TextDelta(text="x")], name=t)
    assert again.first_seq == again.last_seq == 2
    events = [e for page in [p async for p in eventlog.pages_after(t, 0)] for e in page]
    assert [e.seq for e in events] == [1, 2]


async def test_timestamp_cursor_maps_to_exact_seq(eventlog: EventLog) -> None:
    t = task()
    appended = await eventlog.append(
        t, "turn_a", [TextDelta(text="x") for _ in range(37)], name=t, new_task=True
    )
    for i, ts in enumerate(appended.timestamps):
        assert await eventlog.seq_at_timestamp(t, ts) == i + 1
    assert await eventlog.seq_at_timestamp(t, appended.timestamps[0] - 1) == 0
    assert await eventlog.seq_at_timestamp(t, appended.timestamps[-1] + 10_000) == 37


async def test_archive_then_expire_then_continue_from_postgres(
    eventlog: EventLog, sessions
) -> None:
    t = task()
    await eventlog.append(
        t, "turn_a", [TextDelta(text=str(i)) for i in range(10)], name=t, new_task=True
    )
    # Archive everything dirty (other tests' tasks too: harmless, idempotent).
    await eventlog.archive_pending()
    await eventlog.archive_pending()
    async with sessions() as session:
        rows = (
            await session.execute(
                select(EventRecord.seq, EventRecord.turn_id)
                .where(EventRecord.task_id == t)
                .order_by(EventRecord.seq)
            )
        ).all()
    assert [r.seq for r in rows] == list(range(1, 11))
    assert {r.turn_id for r in rows} == {"turn_a"}
    key = eventlog.keys.events(t)
    ttl = await eventlog.redis.pttl(key)
    assert 0 < ttl <= eventlog.hot_ttl_ms, "archived stream expires after the active TTL"

    # The hot copy goes away (as the TTL would do); numbering and timestamps
    # continue from PostgreSQL and reads stitch both stores together.
    last_ts = (await eventlog.read_cold(t, 9, None))[0]
    await eventlog.redis.delete(key, eventlog.keys.archived(t))
    more = await eventlog.append(t, "turn_b", [TextDelta(text="new")], name=t)
    assert more.first_seq == 11
    assert more.timestamps[0] > parse_event(last_ts.data).timestamp
    assert await eventlog.redis.pttl(key) == -1, "unarchived events never expire"
    events = [e for page in [p async for p in eventlog.pages_after(t, 4)] for e in page]
    assert [e.seq for e in events] == list(range(5, 12))
    cold_ts = parse_event(events[0].data).timestamp
    assert await eventlog.seq_at_timestamp(t, cold_ts) == 5


async def test_one_archiving_pass_copies_many_tasks_together(eventlog: EventLog, sessions) -> None:
    """The background pass: 30 small tasks, one with three batches to copy, and one
    another archiver holds (left alone, its dirty mark kept)."""
    small = [task() for _ in range(30)]
    big, held = task(), task()
    for t in small:
        bodies = [TextDelta(text=f"{t}.{i}") for i in range(5)]
        await eventlog.append(t, "turn", bodies, name=t, new_task=True)
    for chunk in range(3):
        bodies = [TextDelta(text=f"big.{chunk}.{i}") for i in range(400)]
        await eventlog.append(big, "turn", bodies, name=big, new_task=chunk == 0)
    await eventlog.append(held, "turn", [TextDelta(text="h")], name=held, new_task=True)
    await eventlog.redis.set(eventlog.keys.archiving(held), "1", px=30_000)

    copied = await eventlog.archive_pending(limit=1000)

    assert copied >= 30 * 5 + 1200  # the session's other dirty tasks may add to it
    async with sessions() as session:
        counts = dict(
            (
                await session.execute(
                    select(EventRecord.task_id, func.count())
                    .where(EventRecord.task_id.in_([*small, big, held]))
                    .group_by(EventRecord.task_id)
                )
            ).all()
        )
    assert counts == {**{t: 5 for t in small}, big: 1200}
    for t, last in [*((t, 5) for t in small), (big, 1200)]:
        assert int(await eventlog.redis.get(eventlog.keys.archived(t))) == last
        assert not await eventlog.redis.exists(eventlog.keys.archiving(t))
        assert await eventlog.redis.zscore(eventlog.keys.archive_dirty, t) is None
        assert 0 < await eventlog.redis.pttl(eventlog.keys.events(t)) <= eventlog.hot_ttl_ms
    assert await eventlog.redis.zscore(eventlog.keys.archive_dirty, held) is not None
    assert await eventlog.redis.get(eventlog.keys.archived(held)) is None
    # What PostgreSQL keeps is the wire JSON byte for byte.
    odd = task()
    await eventlog.append(
        odd, "turn", [TextDelta(text='é 😀 \\u0000 "q" \x01 \u2028')], name=odd, new_task=True
    )
    hot = [e.data for page in [p async for p in eventlog.pages_after(odd, 0)] for e in page]
    await eventlog.archive_pending(limit=1000)
    async with sessions() as session:
        cold = (
            await session.scalars(select(EventRecord.data).where(EventRecord.task_id == odd))
        ).all()
    assert cold == hot

    # The holder gone, the next pass takes it.
    await eventlog.redis.delete(eventlog.keys.archiving(held))
    assert await eventlog.archive_pending(limit=1000) >= 1
    assert int(await eventlog.redis.get(eventlog.keys.archived(held))) == 1


async def test_archiving_twice_writes_each_event_once(eventlog: EventLog, sessions) -> None:
    t = task()
    await eventlog.append(
        t, None, [TextDelta(text="a"), TextDelta(text="b")], name=t, new_task=True
    )
    await eventlog.archive_task(t, 0)
    await eventlog.redis.delete(eventlog.keys.archived(t))  # lose the watermark
    await eventlog.archive_task(t, 0)
    async with sessions() as session:
        seqs = (
            await session.scalars(select(EventRecord.seq).where(EventRecord.task_id == t))
        ).all()
    assert sorted(seqs) == [1, 2]


async def test_archive_now_commits_its_companion_with_the_events(
    eventlog: EventLog, sessions
) -> None:
    # A snapshot is written in the transaction that archives the events it covers:
    # if it fails, those events are not marked archived either, and a retry has both.
    t = task()
    await eventlog.append(
        t, None, [TextDelta(text="a"), TextDelta(text="b")], name=t, new_task=True
    )

    async def failing(session) -> None:
        raise RuntimeError("the snapshot could not be written")

    try:
        await eventlog.archive_now(t, also=failing)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the companion's failure was swallowed")

    async def seqs() -> list[int]:
        async with sessions() as session:
            rows = await session.scalars(select(EventRecord.seq).where(EventRecord.task_id == t))
            return sorted(rows.all())

    assert await seqs() == []
    assert await eventlog.redis.get(eventlog.keys.archived(t)) is None

    ran: list[int] = []

    async def companion(session) -> None:
        # Same transaction: the events it follows are visible to it, not yet committed.
        rows = await session.scalars(select(EventRecord.seq).where(EventRecord.task_id == t))
        ran.extend(rows.all())

    assert await eventlog.archive_now(t, also=companion) == 2
    assert sorted(ran) == [1, 2] and await seqs() == [1, 2]
    # Nothing left to archive: the companion still runs, alone.
    ran.clear()
    assert await eventlog.archive_now(t, also=companion) == 0
    assert sorted(ran) == [1, 2]


async def test_archiving_many_events_in_batches(eventlog: EventLog, sessions) -> None:
    t = task()
    for chunk in range(6):
        bodies = [TextDelta(text=f"{chunk}.{i}") for i in range(200)]
        await eventlog.append(t, None, bodies, name=t, new_task=chunk == 0)
    calls = 0

    async def companion(session) -> None:
        nonlocal calls
        calls += 1

    assert await eventlog.archive_now(t, also=companion) == 1200
    assert calls == 1  # with the last batch only
    assert int(await eventlog.redis.get(eventlog.keys.archived(t))) == 1200
    assert not await eventlog.redis.exists(eventlog.keys.archiving(t))  # claim given back
    async with sessions() as session:
        count = await session.scalar(
            select(func.count()).select_from(EventRecord).where(EventRecord.task_id == t)
        )
    assert count == 1200


async def test_the_script_and_envelope_json_build_the_same_envelope(eventlog: EventLog) -> None:
    """The append script builds each stored envelope (seq and timestamp exist only
    there); ``envelope_json`` is its Python twin, which the gateway uses for the first
    frame of a turn it just appended. The two must agree byte for byte."""
    t = task()
    bodies = [
        (None, body_json(ThreadLifecycle(phase="started"))),
        ("turn_a", body_json(TextDelta(text='quote " and \\ and é'))),
    ]
    for turn_id, body in bodies:
        appended = await eventlog.append_bodies(
            t, turn_id, [("x", body)], name=f"{t}-name", new_task=True
        )
        (stored,) = await eventlog.read_hot(t, appended.first_seq - 1, count=1)
        expected = envelope_json(
            f"{t}-name", turn_id, appended.first_seq, appended.timestamps[0], body
        )
        assert stored.data == expected


def test_the_catalogue_reads_envelopes() -> None:
    assert {"thread_lifecycle", "text_delta", "heartbeat", "usage"} <= EVENT_TYPES
    # A tool input with a "turn_id" key of its own does not fool turn_of.
    call = ToolCall(tool="x", tool_call_id="c1", input={"turn_id": "not-this"})
    unowned = envelope_json("t", None, 1, 5, body_json(call))
    owned = envelope_json("t", "turn_a", 1, 5, body_json(call))
    assert turn_of(unowned) is None and turn_of(owned) == "turn_a"
    done = envelope_json("t", "turn_a", 2, 6, body_json(ThreadLifecycle(phase="completed")))
    started = envelope_json("t", "turn_a", 3, 7, body_json(ThreadLifecycle(phase="started")))
    assert ends_turn("thread_lifecycle", done) and ends_turn("thread_lifecycle", done, "turn_a")
    assert not ends_turn("thread_lifecycle", done, "turn_b")
    assert not ends_turn("thread_lifecycle", started)
    beat = {"type": "heartbeat", "task_id": "t", "timestamp": 9}
    assert json.loads(heartbeat_json("t", 9)) == beat


def append_keys(eventlog: EventLog, t: str) -> list[str]:
    """The KEYS of the append script for task ``t``, in its order."""
    return [
        eventlog.keys.events(t),
        eventlog.keys.archived(t),
        eventlog.keys.running_turn(t),
        eventlog.keys.turn_epoch(t),
    ]


async def test_a_retried_append_that_had_landed_is_not_appended_again(eventlog: EventLog) -> None:
    """A failover can cut the reply of an append that landed (and reached the replica
    that takes over); the cluster path retries with the same token and the retry
    flag, and the script answers as the first call did."""
    t = task()
    keys = append_keys(eventlog, t)
    bodies = [
        "text_delta",
        body_json(TextDelta(text="a")),
        "text_delta",
        body_json(TextDelta(text="b")),
    ]

    def args(token: str, retry: str) -> list[str]:
        return [t, "turn_a", "0", "0", "", "", token, retry, *bodies]

    first = await eventlog._append(keys=keys, args=args("tok-1", ""))
    again = await eventlog._append(keys=keys, args=args("tok-1", "1"))
    assert again == first and first[0] == 1 and len(first) == 3
    assert await eventlog.redis.xlen(keys[0]) == 2
    # Another append in between does not hide it from the retry.
    other = await eventlog._append(keys=keys, args=args("tok-2", ""))
    assert other[0] == 3
    assert await eventlog._append(keys=keys, args=args("tok-1", "1")) == first
    # A retry whose first call never landed appends.
    fresh = await eventlog._append(keys=keys, args=args("tok-3", "1"))
    assert fresh[0] == 5 and await eventlog.redis.xlen(keys[0]) == 6
    # Readers see the same events whatever the extra field.
    events = [e for page in [p async for p in eventlog.pages_after(t, 0)] for e in page]
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]


async def test_a_retried_append_of_many_events_that_had_landed_is_not_appended_again(
    eventlog: EventLog,
) -> None:
    """The retry looks back as far as the append is long: a batch of 164 events
    (a fast model's whole answer, coalesced while a failover held the first
    call) was appended twice in a chaos run when it looked only 64 back."""
    t = task()
    keys = append_keys(eventlog, t)
    bodies = [
        part for i in range(164) for part in ("text_delta", body_json(TextDelta(text=f"{i}")))
    ]
    args = [t, "turn_a", "0", "0", "", "", "tok-big", "", *bodies]
    first = await eventlog._append(keys=keys, args=args)
    args[7] = "1"
    assert await eventlog._append(keys=keys, args=args) == first
    assert await eventlog.redis.xlen(keys[0]) == 164


async def test_a_failed_tool_result_reads_back(eventlog: EventLog) -> None:
    # A failed call has no output, and body_json leaves the null out: the
    # engine must read back what it wrote (a resumed turn, a task's status).
    t = task()
    await eventlog.append(
        t, "turn_a", [ToolResult(tool_call_id="call_1", error="denied")], name=t, new_task=True
    )
    [page] = [p async for p in eventlog.pages_after(t, 0)]
    parsed = parse_event(page[0].data)
    assert isinstance(parsed, ToolResult)
    assert parsed.output is None and parsed.error == "denied"
