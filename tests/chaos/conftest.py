"""Each chaos module runs on a database of its own (see tests/isolation.py).

``--soak-minutes N`` (or ``HOLDFAST_CHAOS_SOAK_MINUTES``) sets how long
``test_soak.py`` runs; the option is known when pytest is pointed at this
directory or a file in it, the variable always.
"""

from __future__ import annotations

import os

import pytest

from tests.isolation import own_api_keys, own_database_url

__all__ = ["own_api_keys", "own_database_url", "soak_minutes"]

SOAK_MINUTES_ENV = "HOLDFAST_CHAOS_SOAK_MINUTES"
DEFAULT_SOAK_MINUTES = 5.0  # what CI runs
# Beyond the soak itself: start, the archive catching up, every log read and checked.
SOAK_MARGIN_SECONDS = 600


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak-minutes",
        type=float,
        default=None,
        help=f"how long tests/chaos/test_soak.py runs (default {DEFAULT_SOAK_MINUTES:g}; "
        f"also {SOAK_MINUTES_ENV})",
    )


def soak_minutes(config: pytest.Config) -> float:
    given = config.getoption("--soak-minutes", default=None)
    if given is None:
        given = float(os.environ.get(SOAK_MINUTES_ENV) or DEFAULT_SOAK_MINUTES)
    if given <= 0:
        raise pytest.UsageError(f"--soak-minutes must be positive, not {given:g}")
    return float(given)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The soak's time limit follows its length (pytest-timeout reads the marker).
    for item in items:
        if item.nodeid.startswith("tests/chaos/test_soak.py"):
            seconds = soak_minutes(config) * 60 + SOAK_MARGIN_SECONDS
            item.add_marker(pytest.mark.timeout(seconds))
