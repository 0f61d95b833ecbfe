"""TurnStop: a turn takes back exactly its own stop requests; an outside cancel wins."""

from __future__ import annotations

import asyncio

import pytest
from holdfast_loop_worker import stopping
from holdfast_loop_worker.stopping import TurnStop


async def _turn(stop: TurnStop, started: asyncio.Event) -> str:
    try:
        started.set()
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        reason = stop.consume()
        if reason is None:
            raise
        await asyncio.sleep(0)  # ending properly needs to await again
        return reason
    return "ran out"


async def _started(stop: TurnStop) -> asyncio.Task[str]:
    started = asyncio.Event()
    task = asyncio.create_task(_turn(stop, started))
    stop.bind(task)
    await started.wait()
    return task


async def test_a_requested_stop_is_taken_back_and_the_turn_ends_itself() -> None:
    stop = TurnStop()
    task = await _started(stop)
    assert stop.request("handoff")
    assert await task == "handoff"
    assert task.cancelling() == 0
    assert not stop.request("cancel"), "a finished turn is not stopped again"


async def test_cancel_wins_over_handoff() -> None:
    stop = TurnStop()
    task = await _started(stop)
    stop.request("cancel")
    stop.request("handoff")
    assert await task == "cancel"


async def test_an_outside_cancel_wins() -> None:
    stop = TurnStop()
    task = await _started(stop)
    stop.request("cancel")
    task.cancel()  # e.g. the worker shutting down at the same moment
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_outside_cancel_alone_is_not_consumed() -> None:
    stop = TurnStop()
    task = await _started(stop)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _turn_that_loses_its_first_stop(stop: TurnStop, started: asyncio.Event) -> str:
    """As a turn whose stop landed in a redis-py ``wait_for`` the tick its command
    completed (CPython 3.11, python/cpython#86296): the cancel is gone, the task
    stays "cancelling", and it runs on."""
    lost = False
    while True:
        try:
            started.set()
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if not lost:
                lost = True
                continue
            reason = stop.consume()
            if reason is None:
                raise
            return reason


async def test_a_stop_the_turn_lost_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stopping, "RECANCEL_SECONDS", 0.05)
    stop = TurnStop()
    started = asyncio.Event()
    task = asyncio.create_task(_turn_that_loses_its_first_stop(stop, started))
    stop.bind(task)
    await started.wait()
    assert stop.request("handoff")
    assert await asyncio.wait_for(task, 10) == "handoff"
    assert task.cancelling() == 0, "every cancel it was sent is taken back"
