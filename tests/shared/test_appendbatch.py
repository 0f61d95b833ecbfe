"""Appends of concurrent turns share pipelines (eventlog/append.py's AppendBatcher), and each
keeps its own reply, its order within its task, and "not written" when cancelled
before it was sent. Against the real Redis, through the event log."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from holdfast_shared.eventlog import EventLog
from holdfast_shared.events import TextDelta, ThreadLifecycle


def task() -> str:
    return f"ab-{secrets.token_hex(6)}"


async def test_concurrent_appends_share_pipelines_and_keep_their_replies(
    eventlog: EventLog,
) -> None:
    tasks = [task() for _ in range(50)]
    for t in tasks:
        await eventlog.append(t, "turn", [ThreadLifecycle(phase="started")], name=t, new_task=True)
    batcher = eventlog._batcher
    before_pipelines, before_appends = batcher.pipelines, batcher.appends

    async def stream(t: str) -> list[int]:
        seqs = []
        for i in range(20):
            appended = await eventlog.append(t, "turn", [TextDelta(text=f"{t}:{i}")], name=t)
            seqs.append(appended.first_seq)
        return seqs

    results = await asyncio.gather(*(stream(t) for t in tasks))
    assert all(seqs == list(range(2, 22)) for seqs in results)
    appends = batcher.appends - before_appends
    pipelines = batcher.pipelines - before_pipelines
    assert appends == 50 * 20
    # 50 turns appending at once: most pipelines carry many appends.
    assert pipelines <= appends / 5, (pipelines, appends)
    for t in tasks[:3]:
        events = [e for page in [p async for p in eventlog.pages_after(t, 0)] for e in page]
        texts = [e.data for e in events[1:]]
        assert [f'"{t}:{i}"' in text for i, text in enumerate(texts)] == [True] * 20


async def test_appends_to_one_task_land_in_the_order_they_were_made(eventlog: EventLog) -> None:
    t = task()
    await eventlog.append(t, "turn", [ThreadLifecycle(phase="started")], name=t, new_task=True)
    # Issued in one loop iteration, so they queue together: FIFO keeps their order.
    got = await asyncio.gather(
        *(eventlog.append(t, "turn", [TextDelta(text=str(i))], name=t) for i in range(30))
    )
    assert [a.first_seq for a in got] == list(range(2, 32))


async def test_an_append_cancelled_before_it_was_sent_is_not_written(eventlog: EventLog) -> None:
    t = task()
    await eventlog.append(t, "turn", [ThreadLifecycle(phase="started")], name=t, new_task=True)
    kept = asyncio.ensure_future(eventlog.append(t, "turn", [TextDelta(text="kept")], name=t))
    dropped = asyncio.ensure_future(eventlog.append(t, "turn", [TextDelta(text="dropped")], name=t))
    await asyncio.sleep(0)  # both queued, the flusher not yet run
    dropped.cancel()
    assert (await kept).first_seq == 2
    await asyncio.sleep(0.05)
    events = [e for page in [p async for p in eventlog.pages_after(t, 0)] for e in page]
    assert [e.seq for e in events] == [1, 2]
    assert "dropped" not in "".join(e.data for e in events)


async def test_a_pipeline_waits_for_replicas_once_and_reports_them(
    eventlog: EventLog, caplog: pytest.LogCaptureFixture
) -> None:
    """This Redis has no replica: WAIT answers 0 after its timeout, the appends land
    (the master has them) and the shortfall is logged."""
    waiting = EventLog(
        eventlog.redis,
        eventlog.sessions,
        eventlog.keys,
        hot_ttl_seconds=60,
        wait_replicas=1,
        wait_timeout_ms=20,
    )
    t = task()
    await waiting.append(t, "turn", [ThreadLifecycle(phase="started")], name=t, new_task=True)
    got = await asyncio.gather(
        *(waiting.append(t, "turn", [TextDelta(text=str(i))], name=t) for i in range(5))
    )
    assert [a.first_seq for a in got] == [2, 3, 4, 5, 6]
    assert waiting._batcher.pipelines == 2  # the first append alone, then the five
    assert "reached 0 of 1 replicas" in caplog.text


async def test_an_error_of_one_append_is_its_own(eventlog: EventLog) -> None:
    """Redis refuses one append of a pipeline (its stream key holds a string): that
    caller gets the error, the others in the same pipeline their replies."""
    good, bad = task(), task()
    await eventlog.redis.set(eventlog.keys.events(bad), "not a stream")
    results = await asyncio.gather(
        eventlog.append(good, "turn", [TextDelta(text="a")], name=good, new_task=True),
        eventlog.append(bad, "turn", [TextDelta(text="b")], name=bad, new_task=True),
        eventlog.append(good, "turn", [TextDelta(text="c")], name=good),
        return_exceptions=True,
    )
    assert [type(r).__name__ for r in results] == ["Appended", "ResponseError", "Appended"]
    assert "WRONGTYPE" in str(results[1])
    assert [r.first_seq for r in (results[0], results[2])] == [1, 2]  # type: ignore[union-attr]
    await eventlog.redis.delete(eventlog.keys.events(bad))
