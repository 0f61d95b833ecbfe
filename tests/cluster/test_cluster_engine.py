"""Replay, recovery and HITL on a Redis Cluster: the suite's tests, reused as they are,
with every engine on a real cluster of three masters and three replicas."""

from __future__ import annotations

import pytest

from tests.e2e.test_durable_stream import (
    short_ttl_engine,
    test_resume_after_the_hot_copy_was_trimmed,
    test_two_gateways_serve_one_task,
)
from tests.e2e.test_recovery import (
    cluster,
    test_cancel_stops_a_running_turn_and_the_task_goes_on,
    test_parked_question_survives_a_full_restart,
    test_worker_killed_mid_stream_the_turn_goes_on,
)
from tests.e2e.test_tools_engine import (
    test_answers_that_race_the_parking_turn_are_not_lost,
    test_the_model_asks_the_user_and_the_answer_is_the_result,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

__all__ = [
    "cluster",
    "short_ttl_engine",
    "test_answers_that_race_the_parking_turn_are_not_lost",
    "test_cancel_stops_a_running_turn_and_the_task_goes_on",
    "test_parked_question_survives_a_full_restart",
    "test_resume_after_the_hot_copy_was_trimmed",
    "test_the_model_asks_the_user_and_the_answer_is_the_result",
    "test_two_gateways_serve_one_task",
    "test_worker_killed_mid_stream_the_turn_goes_on",
]
