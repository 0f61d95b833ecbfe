"""The shared consumer-group loop (holdfast_shared.consuming) on a real Redis stream:
delivery and acknowledgement, takeover of an idle entry and of a dead consumer's,
a group recreated after the stream is deleted, and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvloop
from holdfast_learning.consumer import BatchSettings, TrajectoryConsumer
from holdfast_learning.learner import BatchResult
from holdfast_shared.consuming import Delivery, GroupConsumer, consume
from holdfast_shared.jobs import TrajectoryReady
from holdfast_shared.keys import Keys
from redis.asyncio import Redis

GROUP = "testers"
# Generous: these bound waits for things that happen within milliseconds.
WITHIN = 20.0


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WITHIN
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {WITHIN}s: {what}")
        await asyncio.sleep(0.02)


class Recorder:
    """A consumer's work: each delivery becomes a task that acknowledges it, or
    (``hold``) waits until released."""

    def __init__(self, group: GroupConsumer, *, hold: bool = False) -> None:
        self.group = group
        self.hold = hold
        self.release = asyncio.Event()
        self.seen: list[Delivery] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self, delivery: Delivery) -> None:
        self.seen.append(delivery)
        task = asyncio.create_task(self._handle(delivery))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _handle(self, delivery: Delivery) -> None:
        if self.hold:
            await self.release.wait()
        await self.group.ack(delivery.entry_id)

    def run(self, stop: asyncio.Event, *, concurrency: int) -> asyncio.Task[None]:
        """The shared loop, feeding this recorder."""
        work = consume(self.group, stop, self.start, lambda: self.tasks, concurrency=concurrency)
        return asyncio.create_task(work)

    def seen_at_least(self, n: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return len(self.seen) >= n

        return check


@contextlib.asynccontextmanager
async def consuming(recorder: Recorder, *, concurrency: int) -> AsyncIterator[asyncio.Task[None]]:
    """The loop running for the block; stopped (and its end awaited) after it."""
    stop = asyncio.Event()
    loop = recorder.run(stop, concurrency=concurrency)
    try:
        yield loop
    finally:
        stop.set()
        await asyncio.wait_for(loop, WITHIN)


async def new_group(redis: Redis, redis_prefix: str, name: str = "c1", **kw: Any) -> GroupConsumer:
    """A consumer of a new stream's group (created)."""
    group = GroupConsumer(redis, stream_name(redis_prefix), GROUP, name, **kw)
    await group.ensure_group()
    return group


def stream_name(redis_prefix: str) -> str:
    return f"{redis_prefix}test:consuming:{uuid.uuid4().hex}"


async def pending_count(redis: Redis, stream: str) -> int:
    summary = await redis.xpending(stream, GROUP)
    return int(summary["pending"])


async def test_entries_are_delivered_once_and_acknowledged(redis: Redis, redis_prefix: str) -> None:
    group = await new_group(redis, redis_prefix, claim_idle_ms=60_000)
    stream = group.stream
    ids = [await redis.xadd(stream, {"n": str(n)}) for n in range(5)]
    recorder = Recorder(group)
    async with consuming(recorder, concurrency=2):

        async def all_seen() -> bool:
            return len(recorder.seen) == 5 and await pending_count(redis, stream) == 0

        await until(all_seen, "five entries delivered and acknowledged")
        assert [d.entry_id for d in recorder.seen] == ids
        assert [d.fields for d in recorder.seen] == [{"n": str(n)} for n in range(5)]
        assert not any(d.taken_over for d in recorder.seen)


async def test_concurrency_bounds_the_running_tasks(redis: Redis, redis_prefix: str) -> None:
    group = await new_group(redis, redis_prefix, claim_idle_ms=60_000)
    stream = group.stream
    for n in range(4):
        await redis.xadd(stream, {"n": str(n)})
    recorder = Recorder(group, hold=True)
    async with consuming(recorder, concurrency=2):
        await until(recorder.seen_at_least(2), "two entries started")
        assert len(recorder.seen) == 2
        # A full consumer reads nothing more: the other two are still undelivered.
        groups = await redis.xinfo_groups(stream)
        assert groups[0]["pending"] == 2
        recorder.release.set()

        async def all_done() -> bool:
            return len(recorder.seen) == 4 and await pending_count(redis, stream) == 0

        await until(all_done, "the other two delivered once the first two ended")


async def abandoned_entry(redis: Redis, redis_prefix: str) -> tuple[str, str]:
    """A new stream with one entry that consumer ``dead`` read and never acknowledged."""
    dead = await new_group(redis, redis_prefix, "dead", claim_idle_ms=60_000)
    entry_id = await redis.xadd(dead.stream, {"n": "1"})
    assert [d.entry_id for d in await dead.read_new(1, block_ms=100)] == [entry_id]
    return dead.stream, entry_id


async def test_an_idle_entry_of_another_consumer_is_taken_over(
    redis: Redis, redis_prefix: str
) -> None:
    stream, entry_id = await abandoned_entry(redis, redis_prefix)
    # Not idle for a lease yet: it stays the dead one's.
    patient = GroupConsumer(redis, stream, GROUP, "patient", claim_idle_ms=60_000)
    assert await patient.next_entries(10, block_ms=1) == []
    live = GroupConsumer(redis, stream, GROUP, "live", claim_idle_ms=100)
    got: list[Delivery] = []

    async def taken() -> bool:
        got.extend(await live.next_entries(10, block_ms=1))
        return bool(got)

    await until(taken, "the idle entry taken over")
    assert got == [Delivery(entry_id, {"n": "1"}, True)]
    pending = await redis.xpending_range(stream, GROUP, min="-", max="+", count=10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(entry_id, "live")]


async def test_the_take_over_scan_goes_on_from_its_cursor(redis: Redis, redis_prefix: str) -> None:
    stream = stream_name(redis_prefix)
    dead = GroupConsumer(redis, stream, GROUP, "dead", claim_idle_ms=0)
    await dead.ensure_group()
    for n in range(30):
        await redis.xadd(stream, {"n": str(n)})
    assert len(await dead.read_new(30, block_ms=100)) == 30
    # Each take goes on where the last stopped: from the start, each would take the
    # oldest entry again (idle for 0 ms is idle enough).
    live = GroupConsumer(redis, stream, GROUP, "live", claim_idle_ms=0, claim_calls=2)
    taken = [d.entry_id for _ in range(30) for d in await live.take_over(1)]
    assert len(taken) == len(set(taken)) == 30


async def test_a_dead_consumers_entries_are_taken_with_its_name(
    redis: Redis, redis_prefix: str
) -> None:
    stream, entry_id = await abandoned_entry(redis, redis_prefix)
    live = GroupConsumer(redis, stream, GROUP, "live", claim_idle_ms=60_000)
    alive_key = f"{stream}:alive:".__add__
    await redis.set(alive_key("live"), "1", ex=60)
    claimed: list[tuple[str, Delivery]] = []

    async def taken() -> bool:
        # Claimed once idle for half a liveness TTL (0.1 s here).
        claimed.extend(await live.take_from_dead(alive_key, liveness_seconds=0.2, count=10))
        return bool(claimed)

    await until(taken, "the dead consumer's entry taken")
    assert claimed == [("dead", Delivery(entry_id, {"n": "1"}, True))]
    # A consumer with a liveness key keeps its entries.
    await redis.set(alive_key("live2"), "1", ex=60)
    live2 = GroupConsumer(redis, stream, GROUP, "live2", claim_idle_ms=60_000)
    assert await live2.take_from_dead(alive_key, liveness_seconds=0.01, count=10) == []


async def test_the_group_is_recreated_after_the_stream_is_deleted(
    redis: Redis, redis_prefix: str
) -> None:
    created = 0

    async def on_group_created() -> None:
        nonlocal created
        created += 1

    group = await new_group(
        redis, redis_prefix, claim_idle_ms=60_000, on_group_created=on_group_created
    )
    stream = group.stream
    recorder = Recorder(group)
    async with consuming(recorder, concurrency=4) as loop:
        await redis.xadd(stream, {"n": "before"})
        await until(recorder.seen_at_least(1), "the first entry delivered")
        # Redis lost its data: the stream and its group are gone (NOGROUP on the next read).
        await redis.delete(stream)

        async def recreated() -> bool:
            return created == 2

        await until(recreated, "the group created again")
        await redis.xadd(stream, {"n": "after"})
        await until(recorder.seen_at_least(2), "an entry added after the loss delivered")
        assert [d.fields["n"] for d in recorder.seen] == ["before", "after"]
        assert not loop.done()


async def test_stop_ends_the_loop_within_a_read_and_leaves_running_tasks_to_the_caller(
    redis: Redis, redis_prefix: str
) -> None:
    group = await new_group(redis, redis_prefix, claim_idle_ms=60_000)
    stream = group.stream
    await redis.xadd(stream, {"n": "1"})
    recorder = Recorder(group, hold=True)
    stop = asyncio.Event()
    loop = recorder.run(stop, concurrency=4)
    await until(recorder.seen_at_least(1), "the entry started")
    stop.set()
    # Within one blocking read (a second), however slow the machine is, give or take.
    await asyncio.wait_for(loop, WITHIN)
    (task,) = recorder.tasks
    assert not task.done() and await pending_count(redis, stream) == 1
    recorder.release.set()
    await task
    assert await pending_count(redis, stream) == 0


async def test_a_cancel_from_outside_ends_the_loop_and_its_read(
    redis_url: str, redis_prefix: str
) -> None:
    name = f"consuming-{uuid.uuid4().hex[:8]}"
    own = Redis.from_url(redis_url, decode_responses=True, client_name=name)
    try:
        recorder = Recorder(await new_group(own, redis_prefix, claim_idle_ms=60_000))
        loop = recorder.run(asyncio.Event(), concurrency=4)

        async def blocked_in_a_read() -> bool:
            clients = await own.client_list()
            return any(c["name"] == name and c["cmd"] == "xreadgroup" for c in clients)

        await until(blocked_in_a_read, "the consumer blocked in XREADGROUP")
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop

        async def read_ended() -> bool:
            return not await blocked_in_a_read()

        # The read under way went with it (its connection closed), not left blocked.
        await until(read_ended, "the read cancelled with the loop")
        assert recorder.seen == []
    finally:
        await own.aclose()
        await own.connection_pool.disconnect()


class CountingLearner:
    """The learning intake's learner, reduced to what it was asked (the intake is
    what is tested here; learning itself is tests/memory)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def learn(self, trajectory_ids: list[str]) -> BatchResult:
        self.asked += trajectory_ids
        return BatchResult(learned=len(trajectory_ids))


async def test_the_learning_intake_goes_on_after_its_stream_is_deleted(
    redis: Redis, redis_prefix: str
) -> None:
    """Before the shared loop, a NOGROUP ended the intake's task for good: nothing
    more was read from the stream until the process restarted."""
    keys = Keys(f"{redis_prefix}learn{uuid.uuid4().hex[:8]}:")
    learner = CountingLearner()
    consumer = TrajectoryConsumer(
        redis,
        keys,
        learner,  # type: ignore[arg-type]
        BatchSettings(size=10, window_seconds=0.05, claim_idle_seconds=60),
        name="learner-1",
    )
    intake = asyncio.create_task(consumer.run())
    try:
        announce = TrajectoryReady(trajectory_id="t1", tenant_id="a")
        await redis.xadd(keys.trajectories, announce.to_fields())

        async def learned(n: int) -> Callable[[], Awaitable[bool]]:
            async def check() -> bool:
                assert not intake.done(), intake
                return len(learner.asked) >= n

            return check

        await until(await learned(1), "the first announcement learned")
        await redis.delete(keys.trajectories)
        # The intake's next read meets NOGROUP; it recreates the group.
        again = TrajectoryReady(trajectory_id="t2", tenant_id="a")

        async def group_back() -> bool:
            assert not intake.done(), intake
            return bool(await redis.exists(keys.trajectories))

        await until(group_back, "the learning group recreated")
        await redis.xadd(keys.trajectories, again.to_fields())
        await until(await learned(2), "an announcement after the loss learned")
        assert learner.asked == ["t1", "t2"]
    finally:
        intake.cancel()
        with pytest.raises(asyncio.CancelledError):
            await intake


def test_a_connection_closed_under_a_read_is_waited_out(redis_url: str, redis_prefix: str) -> None:
    """Under uvloop (as the services run), a command on a connection whose transport
    was closed under it raises RuntimeError ("the handler is closed"), not a
    ConnectionError: met by a loop-worker whose cluster client closed its nodes for a
    failover while the turns read used one, it ended the worker. The read now
    counts it as Redis away for a moment, and the next one reads on a new connection."""

    async def main() -> tuple[list[Delivery], list[Delivery]]:
        redis = Redis.from_url(redis_url, decode_responses=True, max_connections=1)
        try:
            group = await new_group(redis, redis_prefix, claim_idle_ms=60_000)
            await redis.xadd(group.stream, {"n": "1"})
            connection = await redis.connection_pool.get_connection()
            assert connection._writer is not None
            connection._writer.transport.close()  # what the cluster client's aclose does
            await redis.connection_pool.release(connection)
            during = await group.next_entries(1, block_ms=10)
            after = await group.next_entries(1, block_ms=10)
            await redis.delete(group.stream)
            return during, after
        finally:
            await redis.aclose()

    during, after = uvloop.run(main())
    assert during == []
    assert [d.fields for d in after] == [{"n": "1"}]
