"""Settling an effectful call whose outcome is unknown (#26), step by step on an
in-memory turn: announced once, parked, and each answer — or none — gives the
model exactly one outcome."""

from __future__ import annotations

import pytest
from holdfast_loop_worker.hitl import Answer
from holdfast_loop_worker.turn import tool_step
from holdfast_loop_worker.turn_state import PendingCall
from holdfast_shared.errors import Parked
from holdfast_shared.events import HitlRequest, HitlResolved, ToolOutcomeUnknown
from holdfast_shared.jobs import ToolOutcome, UnknownOutcome, idempotency_key

from tests.loop_worker.fake_turn import FakeTurn


def _lost(attempt: int = 1) -> ToolOutcome:
    return ToolOutcome(
        unknown=UnknownOutcome(
            reason="its runner stopped mid-call", attempt=attempt, sent_at=1, runner_lost_at=2
        )
    )


def _parked(turn: FakeTurn) -> tuple[PendingCall, str]:
    """A bash call whose runner was lost: the turn parks on an outcome_unknown request."""
    call = PendingCall("call_1", "bash", {"command": "pay 5"})
    turn.tool_outcomes.append(_lost())
    return call, call.id


async def _ask(turn: FakeTurn, call: PendingCall) -> str:
    with pytest.raises(Parked):
        await tool_step.call_outcome(turn, call)
    assert call.settle_request is not None
    return call.settle_request


async def test_the_unknown_outcome_is_announced_once_and_parks() -> None:
    turn = FakeTurn(agent_tools=("bash",))
    call, _ = _parked(turn)
    request = await _ask(turn, call)
    unknown, asked = turn.events
    assert isinstance(unknown, ToolOutcomeUnknown) and isinstance(asked, HitlRequest)
    assert asked.kind == "outcome_unknown" and asked.request_id == request
    job = turn.job
    key = idempotency_key(job.tenant_id, job.task_id, job.turn_id, call.id)
    assert unknown.idempotency_key == key == (asked.tool_call or {})["idempotency_key"]
    assert (unknown.sent_at, unknown.runner_lost_at, unknown.attempt) == (1, 2, 1)
    # Resumed while still unanswered (the stored outcome is unknown again): no second
    # announcement, no second question.
    turn.tool_outcomes.append(_lost())
    assert await _ask(turn, call) == request
    assert len(turn.events) == 2 and len(turn.questions) == 1


@pytest.mark.parametrize(
    ("answer", "feedback", "expected"),
    [
        (
            "succeeded",
            "paid, ref 42",
            ToolOutcome(
                output={"status": "succeeded", "settled_by": "a person", "result": "paid, ref 42"}
            ),
        ),
        ("failed", None, None),
    ],
)
async def test_succeeded_and_failed_are_the_one_result(
    answer: str, feedback: str | None, expected: ToolOutcome | None
) -> None:
    turn = FakeTurn(agent_tools=("bash",))
    call, _ = _parked(turn)
    request = await _ask(turn, call)
    turn.answers[request] = Answer("answered", answer, feedback)
    turn.tool_outcomes.append(_lost())  # what the resumed turn reads back
    outcome = await tool_step.call_outcome(turn, call)
    if expected is not None:
        assert outcome == expected
    else:
        assert outcome.error is not None and "did not take effect" in outcome.error
    assert isinstance(turn.events[-1], HitlResolved)
    assert ("retry", 2) not in turn.calls, "never run again"


async def test_retry_runs_the_next_attempt_and_a_lost_retry_is_asked_again() -> None:
    turn = FakeTurn(agent_tools=("bash",))
    call, _ = _parked(turn)
    first = await _ask(turn, call)
    turn.answers[first] = Answer("answered", "retry")
    turn.tool_outcomes += [_lost(), _lost(attempt=2)]  # read back; then the retry is lost too
    second = await _ask(turn, call)
    assert second != first and ("retry", 2) in turn.calls
    assert [type(e).__name__ for e in turn.events].count("ToolOutcomeUnknown") == 2
    turn.answers[second] = Answer("answered", "retry")
    turn.tool_outcomes += [_lost(attempt=2), ToolOutcome(output={"ran": "bash"})]
    outcome = await tool_step.call_outcome(turn, call)
    assert outcome.output == {"ran": "bash"} and ("retry", 3) in turn.calls


async def test_unanswered_past_the_ttl_the_model_is_told_it_stayed_unknown() -> None:
    turn = FakeTurn(agent_tools=("bash",))
    call, _ = _parked(turn)
    request = await _ask(turn, call)
    turn.answers[request] = Answer("expired")
    turn.tool_outcomes.append(_lost())
    outcome = await tool_step.call_outcome(turn, call)
    assert outcome.error is not None and "before the request expired" in outcome.error
    assert not isinstance(turn.events[-1], HitlResolved)


async def test_a_permission_granted_before_an_unknown_outcome_is_resolved_once() -> None:
    """The soak's finding (#29): a call asked permission, ran, and its runner was lost.
    The park on its outcome_unknown snapshots past the permission's ``hitl_resolved``,
    so a resume no longer sees that event in the log; the call itself remembers it,
    and each resume logs no second one."""
    turn = FakeTurn(agent_tools=("bash",), rules={"bash": "ask"})
    call = PendingCall("call_1", "bash", {"command": "pay 5"})
    with pytest.raises(Parked):
        await tool_step.call_outcome(turn, call)
    assert call.hitl_request is not None
    turn.answers[call.hitl_request] = Answer("answered", "yes")
    turn.tool_outcomes.append(_lost())
    settle = await _ask(turn, call)
    # Two resumes, each from the park's snapshot (nothing after it in the log), the
    # second one answered.
    for answer in (None, Answer("answered", "failed")):
        turn.tool_outcomes.append(_lost())
        if answer is None:
            await _ask(turn, call)
        else:
            turn.answers[settle] = answer
            await tool_step.call_outcome(turn, call)
    resolved = [e.request_id for e in turn.events if isinstance(e, HitlResolved)]
    assert resolved == [call.hitl_request, settle]


async def test_a_settled_result_logged_before_a_crash_is_the_one_the_model_sees() -> None:
    """The chaos run's finding (#29): a person settled a lost call as failed, the
    worker logged that result and was killed before its snapshot, and the stalled
    runner, woken, stored the call's real result meanwhile. The resumed turn tells
    the model what the client was shown, and neither runs nor logs the call again."""
    turn = FakeTurn(agent_tools=("bash",))
    settled = ToolOutcome(error="this bash call did not take effect (settled as failed).")
    call = PendingCall("call_1", "bash", {"command": "pay 5"})
    turn.state.stage, turn.state.pending = "tools", [call]
    turn.seen.tool_results[call.id] = settled  # as announce_resume reads it from the log
    turn.tool_outcomes.append(ToolOutcome(output={"exit_code": 0, "stdout": "paid"}))
    await tool_step.run_tools(turn)
    assert turn.events == [] and turn.calls == []
    _, content = turn.messages[-1]
    assert content["blocks"] == [
        {"type": "tool_result", "tool_use_id": call.id, "output": None, "error": settled.error}
    ]
