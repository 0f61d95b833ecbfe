"""Due times of schedules (``holdfast_gateway.schedules.when``): cron in a time
zone across both DST changes, intervals, one-shot times, and catch-up."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from holdfast_gateway.schedules.when import When, check_cron, zone

NY = "America/New_York"
ANCHOR = datetime(2026, 1, 1, tzinfo=UTC)


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


def cron(expression: str, timezone: str = NY) -> When:
    return When(timezone=timezone, anchor_at=ANCHOR, cron=expression)


def test_a_time_the_spring_change_skips_fires_at_the_first_minute_after_it() -> None:
    # 2026-03-08, New York: 02:00 EST becomes 03:00 EDT; 02:30 does not exist.
    daily = cron("30 2 * * *")
    before = datetime(2026, 3, 7, 12, tzinfo=zone(NY))
    assert daily.next_after(before) == utc(2026, 3, 8, 7)  # 03:00 EDT
    # The day after, 02:30 is 02:30 EDT again (06:30 UTC), 23 hours later.
    assert daily.next_after(utc(2026, 3, 8, 7)) == utc(2026, 3, 9, 6, 30)
    assert daily.due_until(utc(2026, 3, 7, 7, 30), utc(2026, 3, 9, 7), 10) == [
        utc(2026, 3, 7, 7, 30),
        utc(2026, 3, 8, 7),
        utc(2026, 3, 9, 6, 30),
    ]


def test_a_time_the_fall_change_repeats_fires_once() -> None:
    # 2026-11-01, New York: 02:00 EDT becomes 01:00 EST; 01:30 happens twice.
    daily = cron("30 1 * * *")
    first = daily.next_after(datetime(2026, 10, 31, 12, tzinfo=zone(NY)))
    assert first == utc(2026, 11, 1, 5, 30)  # 01:30 EDT
    # Not at 01:30 EST (06:30 UTC) the same night: the next day's.
    assert daily.next_after(first) == utc(2026, 11, 2, 6, 30)
    assert daily.next_after(utc(2026, 11, 1, 6)) == utc(2026, 11, 2, 6, 30)
    assert daily.due_until(utc(2026, 11, 1, 5), utc(2026, 11, 2, 7), 10) == [
        utc(2026, 11, 1, 5, 30),
        utc(2026, 11, 2, 6, 30),
    ]


def test_an_hourly_schedule_follows_elapsed_time_across_both_changes() -> None:
    hourly = cron("0 * * * *")
    # Fall back: both 01:00s (05:00 and 06:00 UTC), each hour once.
    assert hourly.due_until(utc(2026, 11, 1, 4), utc(2026, 11, 1, 7), 10) == [
        utc(2026, 11, 1, 4),
        utc(2026, 11, 1, 5),
        utc(2026, 11, 1, 6),
        utc(2026, 11, 1, 7),
    ]
    # Spring forward: 01:00 EST then 03:00 EDT, one hour apart.
    assert hourly.next_after(utc(2026, 3, 8, 6)) == utc(2026, 3, 8, 7)


def test_cron_is_read_in_the_schedule_zone() -> None:
    assert cron("0 9 * * *", "Europe/Paris").next_after(utc(2026, 6, 1)) == utc(2026, 6, 1, 7)
    assert cron("0 9 * * *", "UTC").next_after(utc(2026, 6, 1)) == utc(2026, 6, 1, 9)


def test_catch_up_keeps_the_latest_due_times_of_a_long_outage() -> None:
    minutely = cron("* * * * *")
    # A year of minutes missed: the latest three, without walking the year.
    found = minutely.due_until(utc(2025, 6, 1), utc(2026, 6, 1, 12, 0, 30), 3)
    assert found == [utc(2026, 6, 1, 11, 58), utc(2026, 6, 1, 11, 59), utc(2026, 6, 1, 12)]
    assert minutely.due_until(utc(2026, 6, 1, 12, 1), utc(2026, 6, 1, 12, 0, 30), 3) == []


def test_intervals_count_from_the_anchor() -> None:
    every = When(timezone=NY, anchor_at=ANCHOR, interval_seconds=90)
    assert every.next_after(ANCHOR) == ANCHOR + timedelta(seconds=90)
    assert every.next_after(ANCHOR - timedelta(days=1)) == ANCHOR + timedelta(seconds=90)
    assert every.next_after(ANCHOR + timedelta(seconds=100)) == ANCHOR + timedelta(seconds=180)
    # Across a DST change too: elapsed seconds.
    spring = utc(2026, 3, 8, 6, 59)
    due = every.next_after(spring)
    assert due is not None and timedelta(0) < due - spring <= timedelta(seconds=90)
    assert every.due_until(ANCHOR + timedelta(seconds=90), ANCHOR + timedelta(seconds=400), 2) == [
        ANCHOR + timedelta(seconds=270),
        ANCHOR + timedelta(seconds=360),
    ]


def test_a_one_shot_time_is_due_once() -> None:
    once = When(timezone="UTC", anchor_at=ANCHOR, at=utc(2026, 2, 1))
    assert once.next_after(ANCHOR) == utc(2026, 2, 1)
    assert once.next_after(utc(2026, 2, 1)) is None
    assert once.due_until(utc(2026, 2, 1), utc(2026, 3, 1), 1) == [utc(2026, 2, 1)]


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("* * * *", "five fields"),
        ("0 0 * * * *", "five fields"),
        ("61 * * * *", "not a valid"),
        ("0 0 31 2 *", "not a valid"),
        ("x y z w v", "not a valid"),
    ],
)
def test_bad_cron_expressions_are_refused(expression: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_cron(expression, "UTC")


def test_unknown_zones_are_refused() -> None:
    for name in ("Mars/Olympus", "../etc/passwd", ""):
        with pytest.raises(ValueError, match="unknown time zone"):
            zone(name)
