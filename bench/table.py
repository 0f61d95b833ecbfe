"""The bench's one table: a row per measurement, PASS/MISS against its target.

Every phase returns its rows (:class:`Row`); ``bench.run`` prints them in
the table's order (``bench.phases.PHASES``) whatever order they ran in.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass

from rich.markup import escape
from rich.table import Table


def fmt_rate(value: float) -> str:
    return f"{value:,.0f}/s"


def verdict(ok: bool) -> str:
    return "[bold green]PASS[/]" if ok else "[bold red]MISS[/]"


@dataclass(frozen=True, slots=True)
class Row:
    """One measurement. ``result`` may hold rich markup; ``detail`` is plain
    text (escaped when printed). ``ok`` is the verdict against ``target``,
    ``None`` for a row without one."""

    label: str
    result: str
    base: str = ""  # the raw baseline (or other reference) the ratio divides by
    ratio: str = ""
    target: str = ""
    detail: str = ""
    ok: bool | None = None

    @classmethod
    def error(cls, label: str, exc: BaseException) -> Row:
        """The row of a measurement that failed: the run goes on without it."""
        return cls(
            label, "[bold red]ERROR[/]", detail=f"{type(exc).__name__}: {exc}"[:300], ok=False
        )

    def cells(self) -> tuple[str, ...]:
        mark = "" if self.ok is None else verdict(self.ok)
        return (
            self.label,
            self.result,
            self.base,
            self.ratio,
            self.target,
            mark,
            escape(self.detail),
        )


def machine() -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} CPU x {cpu}; Python {platform.python_version()}"


def render(rows: Iterable[Row], caption: str) -> Table:
    table = Table(title=f"Holdfast bench — {machine()}", show_lines=True)
    table.add_column("Measurement", max_width=34)
    table.add_column("Result", justify="right", no_wrap=True)
    table.add_column("Raw baseline", justify="right", no_wrap=True)
    table.add_column("Ratio", justify="right", no_wrap=True)
    table.add_column("Target", max_width=22)
    table.add_column("", no_wrap=True)
    table.add_column("Detail", max_width=70)
    for row in rows:
        table.add_row(*row.cells())
    table.caption = caption
    return table
