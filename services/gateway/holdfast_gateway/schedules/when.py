"""When a schedule is due: a cron expression in a time zone, an interval, or one instant.

Cron expressions are the five fields of Debian's cron, read by cronsim in
the schedule's zone: a time that a DST change skips (02:30 on the spring-forward
night) fires at the first minute after it (03:00); a time it repeats (01:30 on
the fall-back night) fires once, at its first occurrence. Expressions whose
minute or hour field is a wildcard or step (``*/15 * * * *``) follow elapsed
time instead: an hourly schedule fires at both 01:00s of a fall-back night.
Intervals count elapsed seconds from the schedule's anchor, so DST does not
touch them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from itertools import islice
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

_SECOND = timedelta(seconds=1)
# Steps of cronsim past DST fix-ups before a next due time is given up on.
_MAX_STEPS = 64


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; ValueError when there is none of that name."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(f"unknown time zone {name!r} (an IANA name, e.g. Europe/Paris)") from None


def check_cron(expression: str, timezone: str) -> None:
    """ValueError saying why ``expression`` is not a schedule's cron expression."""
    if len(expression.split()) != 5:
        raise ValueError("a cron expression has five fields: minute hour day month weekday")
    try:
        first = next(CronSim(expression, datetime.now(zone(timezone))))
    except (CronSimError, ValueError) as exc:
        raise ValueError(f"not a valid cron expression: {exc}") from None
    except StopIteration:
        first = None
    if first is None:
        raise ValueError("the cron expression never matches")


@dataclass(frozen=True, slots=True)
class When:
    """One of ``cron``, ``interval_seconds`` or ``at``; times are aware, returned in UTC."""

    timezone: str
    anchor_at: datetime
    cron: str | None = None
    interval_seconds: int | None = None
    at: datetime | None = None

    def next_after(self, moment: datetime) -> datetime | None:
        """The first due time strictly after ``moment`` (None: there is none)."""
        if self.cron is not None:
            # A DST fix-up can yield a time at or before moment (the first
            # 01:30 when moment is past the second): step on.
            for due in islice(self._cron_from(moment), _MAX_STEPS):
                if due > moment:
                    return due.astimezone(UTC)
            return None
        if self.interval_seconds is not None:
            step = timedelta(seconds=self.interval_seconds)
            index = max((moment - self.anchor_at) // step + 1, 1)
            return self.anchor_at + index * step
        assert self.at is not None
        return self.at if self.at > moment else None

    def due_until(self, first: datetime, now: datetime, limit: int) -> list[datetime]:
        """The latest ``limit`` due times from ``first`` to ``now`` (both
        included), oldest first: what a scheduler fires after having handled
        every due time before ``first``."""
        if first > now:
            return []
        if self.cron is not None:
            return self._cron_until(first, now, limit)
        if self.interval_seconds is not None:
            step = timedelta(seconds=self.interval_seconds)
            low = (first - self.anchor_at) // step + (1 if (first - self.anchor_at) % step else 0)
            high = (now - self.anchor_at) // step
            return [
                self.anchor_at + k * step for k in range(max(low, high - limit + 1, 1), high + 1)
            ]
        assert self.at is not None
        return [self.at] if first <= self.at <= now else []

    def _cron_from(self, moment: datetime) -> CronSim:
        """Due times from just after ``moment`` on (aware, in the zone)."""
        assert self.cron is not None
        return CronSim(self.cron, moment.astimezone(zone(self.timezone)))

    def _cron_until(self, first: datetime, now: datetime, limit: int) -> list[datetime]:
        assert self.cron is not None
        # Counted back from now (a long outage of a minutely schedule would be
        # a long walk forward), then walked forward over that stretch: forward
        # is the direction cronsim resolves DST gaps in, the one next_after uses.
        start = first
        back = CronSim(
            self.cron,
            (now.replace(microsecond=0) + _SECOND).astimezone(zone(self.timezone)),
            reverse=True,
        )
        for count, due in enumerate(back, start=1):
            if due < first:
                break
            if count == limit:
                start = max(first, due.astimezone(UTC))
                break
        found: list[datetime] = []
        for due in self._cron_from(start - _SECOND):
            if due > now:
                break
            if due >= first:
                found.append(due.astimezone(UTC))
        return found[-limit:]
