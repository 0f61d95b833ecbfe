"""The event log's tests on a Redis Cluster (tests/shared/test_eventlog.py, reused as they are)."""

from __future__ import annotations

import pytest

from tests.shared.test_eventlog import (
    test_archive_now_commits_its_companion_with_the_events,
    test_archive_then_expire_then_continue_from_postgres,
    test_archiving_many_events_in_batches,
    test_archiving_twice_writes_each_event_once,
    test_seq_and_timestamp_are_assigned_in_order,
    test_timestamp_cursor_maps_to_exact_seq,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

__all__ = [
    "test_archive_now_commits_its_companion_with_the_events",
    "test_archive_then_expire_then_continue_from_postgres",
    "test_archiving_many_events_in_batches",
    "test_archiving_twice_writes_each_event_once",
    "test_seq_and_timestamp_are_assigned_in_order",
    "test_timestamp_cursor_maps_to_exact_seq",
]
