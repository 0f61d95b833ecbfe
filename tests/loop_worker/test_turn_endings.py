"""The turn's one table from how a run stopped to how it ends (``turn/run.py``),
and the ending step (``turn/ending.py``), against an in-memory handle."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from holdfast_loop_worker.executions import ExecutionRun, PauseRequested
from holdfast_loop_worker.stopping import StopReason
from holdfast_loop_worker.turn import ending
from holdfast_loop_worker.turn.ending import (
    Cancel,
    Fail,
    HandBack,
    Outcome,
    Park,
    Pause,
    Reraise,
)
from holdfast_loop_worker.turn.run import outcome_of
from holdfast_shared.agents import AgentNotFound
from holdfast_shared.errors import ErrorCode, Parked, StepInterrupted, Superseded
from holdfast_shared.events import ErrorEvent, ThreadLifecycle, Usage
from holdfast_shared.providers import ProviderError, UnknownModel
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tests.loop_worker.fake_turn import FakeTurn

DEADLINE = 30.0


def _outcome(exc: BaseException, turn: FakeTurn | None = None) -> Outcome:
    return outcome_of(exc, turn or FakeTurn(), DEADLINE)


def test_signals_park_pause_or_pass_through() -> None:
    assert _outcome(Parked("hitl_9")) == Park("hitl_9")
    assert _outcome(PauseRequested()) == Pause(cut=False)
    # Another worker owns the turn now: not this worker's to end.
    assert _outcome(Superseded()) == Reraise()
    assert _outcome(KeyboardInterrupt()) == Reraise()


@pytest.mark.parametrize(
    "exc", [RedisConnectionError("gone"), RedisTimeoutError("slow"), BusyLoadingError("loading")]
)
def test_an_unreachable_redis_leaves_the_job_pending(exc: Exception) -> None:
    # 02ed4fd: a restarting Redis does not end the turn; the consumer keeps the job.
    assert _outcome(exc) == Reraise()


def test_failures_end_the_turn_with_their_code() -> None:
    provider = ProviderError(ErrorCode.LLM_RATE_LIMITED, "slow down", details={"status": 429})
    assert _outcome(provider) == Fail(ErrorCode.LLM_RATE_LIMITED, "slow down", {"status": 429})
    assert _outcome(UnknownModel("nope")) == Fail(ErrorCode.UNKNOWN_MODEL, "nope")
    gone = _outcome(AgentNotFound("helper"))
    assert gone == Fail(ErrorCode.AGENT_NOT_FOUND, "agent 'helper' not found", {"agent": "helper"})
    assert _outcome(ValueError("bug")) == Fail(ErrorCode.INTERNAL, "internal error: ValueError")


def test_a_stream_broken_after_output_stores_its_partial_message() -> None:
    content = {"blocks": [{"type": "text", "text": "hal"}], "interrupted": True}
    exc = StepInterrupted(ProviderError(ErrorCode.LLM_PROVIDER_ERROR, "reset"), content)
    assert _outcome(exc) == Fail(ErrorCode.LLM_PROVIDER_ERROR, "reset", None, store=content)


def test_the_deadline_names_whose_time_ran_out() -> None:
    turn = FakeTurn()
    outcome = _outcome(TimeoutError(), turn)
    assert isinstance(outcome, Fail)
    assert (outcome.code, outcome.close_blocks) == (ErrorCode.DEADLINE_EXCEEDED, True)
    assert "30" in outcome.message
    turn.execution = ExecutionRun("exe_1", 5.0, None, 0, 0.0, datetime.now(UTC))
    turn.execution.budget(DEADLINE, active_ms=0)  # the execution's 5 s is the tighter
    outcome = _outcome(TimeoutError(), turn)
    assert isinstance(outcome, Fail)
    assert (outcome.code, outcome.close_blocks) == (ErrorCode.EXECUTION_MAX_DURATION, True)


async def _stopped(reason: StopReason | None) -> Outcome:
    """How a run ends when its task is cancelled: by ``reason`` through the
    turn's stop, or (None) by someone else."""
    turn = FakeTurn()
    running = asyncio.Event()

    async def run() -> Outcome:
        try:
            running.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            return outcome_of(exc, turn, DEADLINE)
        raise AssertionError("not stopped")

    task = asyncio.create_task(run())
    turn.stop.bind(task)
    await running.wait()
    if reason is None:
        task.cancel()
    else:
        assert turn.stop.request(reason)
    return await task


async def test_stops_from_outside_map_to_their_endings() -> None:
    assert await _stopped("cancel") == Cancel()
    assert await _stopped("handoff") == HandBack()
    assert await _stopped("pause") == Pause(cut=True)
    # A cancellation that is not the turn's own (the worker shutting down hard) wins.
    assert await _stopped(None) == Reraise()


async def test_a_failure_logs_usage_error_and_end_then_frees_the_task() -> None:
    turn = FakeTurn()
    turn.state.add_usage({"input_tokens": 7, "output_tokens": 2})
    assert await ending.failed(turn, ErrorCode.INTERNAL, "boom") == "errored"
    usage, error, last = turn.events
    assert isinstance(usage, Usage) and usage.input_tokens == 7
    assert isinstance(error, ErrorEvent) and error.error == ErrorCode.INTERNAL
    assert isinstance(last, ThreadLifecycle) and last.phase == "errored"
    assert [name for name, _ in turn.calls] == [
        "finish_events",
        "record_end",
        # A failed turn's subagents are cancelled: nothing waits for them.
        "stop_children",
        "end_execution",
        "start_following",
    ]
    assert turn.calls[1][1] == ("errored", None, {"code": "INTERNAL", "message": "boom"})


async def test_usage_already_sent_is_not_sent_again() -> None:
    turn = FakeTurn()
    turn.state.add_usage({"input_tokens": 3})
    turn.reported_usage = dict(turn.state.usage)
    assert await ending.cancelled(turn) == "cancelled"
    (last,) = turn.events
    assert isinstance(last, ThreadLifecycle)
    assert (last.phase, last.stop_reason) == ("completed", "cancelled")


async def test_an_end_logged_before_a_crash_is_only_recorded() -> None:
    turn = FakeTurn()
    turn.seen.terminal = True
    await ending.end(turn, "completed", "end_turn", [])
    assert turn.events == []
    assert [name for name, _ in turn.calls][:2] == ["release_task", "record_end"]


async def _postgres_errors(database_url: str) -> dict[str, Exception]:
    """Real errors of a real PostgreSQL, as SQLAlchemy raises them."""
    from holdfast_shared.db import create_engine
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    caught: dict[str, Exception] = {}
    closed = create_engine("postgresql://postgres@127.0.0.1:1/none", pool_size=1)
    try:
        async with closed.connect() as conn:
            await conn.execute(text("SELECT 1"))
    except DBAPIError as exc:
        caught["refused"] = exc
    await closed.dispose()
    engine = create_engine(database_url, pool_size=1)
    async with engine.connect() as victim, engine.connect() as killer:
        pid = (await victim.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        await killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        try:
            await victim.execute(text("SELECT 1"))
        except DBAPIError as exc:
            caught["terminated"] = exc
    async with engine.connect() as conn:
        try:
            await conn.execute(text("SELECT 1/0"))
        except DBAPIError as exc:
            caught["statement"] = exc
    await engine.dispose()
    return caught


async def test_an_unreachable_postgres_leaves_the_job_pending(database_url: str) -> None:
    # A PostgreSQL that restarts (connections refused or cut) is as passing as a
    # restarting Redis; an error about the statement itself still ends the turn.
    errors = await _postgres_errors(database_url)
    assert _outcome(errors["refused"]) == Reraise()
    assert _outcome(errors["terminated"]) == Reraise()
    failed = _outcome(errors["statement"])
    assert isinstance(failed, Fail) and failed.code == ErrorCode.INTERNAL
