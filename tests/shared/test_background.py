"""Background: loops start with the block, stop with it, and a dead loop stops the block."""

from __future__ import annotations

import asyncio

import pytest
from holdfast_shared.background import RECANCEL_SECONDS, Background, cancel_and_wait, every


async def test_loops_are_cancelled_and_awaited_when_the_block_ends() -> None:
    ran = 0
    cleaned = asyncio.Event()

    async def loop() -> None:
        nonlocal ran
        try:
            while True:
                ran += 1
                await asyncio.sleep(0.01)
        finally:
            cleaned.set()

    async with Background() as background:
        background.start(loop(), name="loop")
        await asyncio.sleep(0.05)
    assert ran > 1 and cleaned.is_set()


async def test_a_loop_that_dies_stops_the_block() -> None:
    async def broken() -> None:
        await asyncio.sleep(0.01)
        raise RuntimeError("a bug")

    with pytest.raises(ExceptionGroup) as raised:
        async with Background() as background:
            background.start(broken(), name="broken")
            await asyncio.sleep(30)  # cancelled by the group
    assert raised.group_contains(RuntimeError, match="a bug")


async def test_every_logs_a_failing_step_and_goes_on() -> None:
    calls = 0
    third = asyncio.Event()

    async def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("Redis is restarting")
        if calls == 3:
            third.set()

    async with Background() as background:
        background.start(every(0.01, step, what="a duty"), name="duty")
        await asyncio.wait_for(third.wait(), 5)
    assert calls >= 3


async def _loses_its_first_cancel(cancels: list[int]) -> None:
    """A loop whose first cancel is lost, as CPython 3.11's ``wait_for`` loses one that
    lands in the tick its inner future completes (python/cpython#86296)."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancels.append(1)
            if len(cancels) > 1:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]


async def test_a_task_that_lost_its_cancel_is_cancelled_again() -> None:
    cancels: list[int] = []
    task = asyncio.create_task(_loses_its_first_cancel(cancels))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 10 * RECANCEL_SECONDS)
    assert task.cancelled() and len(cancels) == 2


async def test_a_loop_that_lost_its_cancel_does_not_hold_the_block() -> None:
    cancels: list[int] = []

    async def block() -> None:
        async with Background() as background:
            background.start(_loses_its_first_cancel(cancels), name="stubborn")
            await asyncio.sleep(0)

    await asyncio.wait_for(block(), 10 * RECANCEL_SECONDS)
    assert len(cancels) == 2
