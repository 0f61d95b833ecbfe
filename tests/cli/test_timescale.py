"""The harness's bounds scale with the machine: one setting, else the load per CPU."""

from __future__ import annotations

import pytest

from holdfast.testing.timescale import MAX_MEASURED, TIME_SCALE_ENV, measure_time_scale


def test_the_setting_wins_over_the_load() -> None:
    assert measure_time_scale({TIME_SCALE_ENV: "2.5"}, load=40.0, cpus=2) == 2.5


def test_unset_it_is_the_load_per_cpu_never_below_one_nor_above_the_cap() -> None:
    assert measure_time_scale({}, load=6.0, cpus=2) == 3.0
    assert measure_time_scale({}, load=0.3, cpus=2) == 1.0
    assert measure_time_scale({}, load=80.0, cpus=2) == MAX_MEASURED


@pytest.mark.parametrize("bad", ["fast", "0", "-1"])
def test_a_bad_setting_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=TIME_SCALE_ENV):
        measure_time_scale({TIME_SCALE_ENV: bad})
