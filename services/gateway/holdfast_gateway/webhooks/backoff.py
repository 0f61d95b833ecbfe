"""How long a failed delivery waits before its next attempt."""

from __future__ import annotations

import random
from collections.abc import Callable


def retry_delay(
    attempt: int, *, base: float, cap: float, rng: Callable[[], float] = random.random
) -> float:
    """Seconds before the attempt after ``attempt`` (1 for the first): exponential,
    ``base·2^(attempt-1)`` up to ``cap``, with jitter over its upper half, so the
    receivers a common outage failed are not all tried again at once, and no
    wait is shorter than half the schedule's."""
    ceiling = min(cap, base * 2.0 ** min(attempt - 1, 62))
    return ceiling / 2 + rng() * ceiling / 2
