"""How much slower than usual this machine runs: one factor for every bound a test waits by.

A readiness or liveness bound ("a worker is ready within 60 s", "a turn ends
within 150 s") is a guess about the machine. On a 2-core VM that other work
keeps at a load of 8, every process gets a quarter of a core and the guess
fails while nothing is wrong. So the harness multiplies its bounds by
:func:`time_scale`, and so do tests with bounds of their own.

``HOLDFAST_TEST_TIME_SCALE`` (a positive number) sets the factor. Unset, it
is the machine's load per CPU (``os.getloadavg()[0] / os.cpu_count()``,
the runnable tasks each core shares its time between), taken once per
process, never below 1 and at most :data:`MAX_MEASURED`; where the load
average is unknown, 1.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

TIME_SCALE_ENV = "HOLDFAST_TEST_TIME_SCALE"
# A measured load above this says more about a stuck machine than a slow one;
# beyond it, set the factor yourself.
MAX_MEASURED = 4.0


def measure_time_scale(
    environ: Mapping[str, str] = os.environ,
    *,
    load: float | None = None,
    cpus: int | None = None,
) -> float:
    """The factor from ``environ`` or, unset, from the load (both passed in by tests)."""
    configured = environ.get(TIME_SCALE_ENV, "").strip()
    if configured:
        try:
            value = float(configured)
        except ValueError:
            raise ValueError(f"{TIME_SCALE_ENV}={configured!r}: not a number") from None
        if not value > 0:
            raise ValueError(f"{TIME_SCALE_ENV}={configured!r}: must be positive")
        return value
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not reported on this platform
            return 1.0
    cpus = cpus or os.cpu_count() or 1
    return min(MAX_MEASURED, max(1.0, load / cpus))


@functools.cache
def time_scale() -> float:
    """This process's factor (see the module docstring): measured once, then kept,
    so every bound of a run scales alike."""
    return measure_time_scale()


def scaled(seconds: float) -> float:
    """``seconds`` times :func:`time_scale`."""
    return seconds * time_scale()
