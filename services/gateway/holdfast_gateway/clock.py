"""The time as the scheduler reads it: passed in, so a test can move it.

Only the scheduler (``schedules/``) and the schedule routes read this clock;
everything else keeps the system's time. ``HOLDFAST_SCHEDULE_CLOCK_OFFSET_SECONDS``
sets it ahead of (or behind) the system clock, for tests only: it lets a test
put a due time or a DST change seconds away.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware (UTC)."""
        ...


@dataclass(frozen=True, slots=True)
class SystemClock:
    """The system's time, ``offset_seconds`` ahead."""

    offset_seconds: float = 0.0

    def now(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.offset_seconds)
