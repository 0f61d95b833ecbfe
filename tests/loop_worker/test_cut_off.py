"""What a snapshot taken mid-step keeps (``turn_state.cut_off``): the cluster
chaos run's finding, a turn handed back while its model step's snapshot was
being written, resumed as finished without its answer."""

from __future__ import annotations

from holdfast_loop_worker.turn_state import PendingCall, TurnState, cut_off


def test_a_hand_back_mid_step_keeps_the_boundary_with_the_time_and_usage_since() -> None:
    boundary = TurnState(stage="model", position=3, iteration=1, last_seq=48, active_ms=900)
    boundary.usage = {"input_tokens": 10}
    now = boundary.copy()
    # What the model step does before its snapshot commits (model_step.model_step).
    now.usage["input_tokens"] = 25
    now.position, now.iteration, now.stage, now.stop_reason = 4, 2, "final", "end_turn"
    now.active_ms, now.calibration = 4_000, 1.2
    kept = cut_off(boundary, now)
    assert (kept.stage, kept.position, kept.iteration, kept.last_seq) == ("model", 3, 1, 48)
    assert kept.stop_reason is None
    assert (kept.usage, kept.active_ms, kept.calibration) == ({"input_tokens": 25}, 4_000, 1.2)
    # Copies: neither side changes the other, nor the boundary.
    kept.usage["input_tokens"] = 0
    assert now.usage == {"input_tokens": 25} and boundary.usage == {"input_tokens": 10}


def test_tool_outcomes_not_yet_committed_are_not_kept() -> None:
    call = PendingCall("call_1", "bash", {"command": "ls"})
    boundary = TurnState(stage="tools", pending=[call])
    now = boundary.copy()
    now.pending[0].outcome = {"output": {"exit_code": 0}}
    kept = cut_off(boundary, now)
    assert kept.stage == "tools" and kept.pending[0].outcome is None
