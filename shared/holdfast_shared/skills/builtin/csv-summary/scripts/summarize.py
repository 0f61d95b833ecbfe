#!/usr/bin/env python3
"""Summarise a CSV file: rows, columns, each column's type, gaps and statistics.

Standard library only, one pass over the file, nothing written. Usage:
``summarize.py FILE [--delimiter D] [--top N] [--no-header] [--json]``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections import Counter
from datetime import date
from typing import Any

csv.field_size_limit(10 * 1024 * 1024)

_MISSING = {"", "na", "n/a", "nan", "null", "none", "-"}
_BOOLEANS = {"true", "false", "yes", "no", "y", "n", "t", "f"}
_THOUSANDS = re.compile(r"-?[0-9]{1,3}(,[0-9]{3})+(\.[0-9]+)?")


def _number(value: str) -> float | None:
    if _THOUSANDS.fullmatch(value):
        value = value.replace(",", "")
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _is_date(value: str) -> bool:
    try:
        date.fromisoformat(value[:10])
    except ValueError:
        return False
    return True


class Column:
    def __init__(self, name: str) -> None:
        self.name = name
        self.count = 0
        self.missing = 0
        self.integers = 0
        self.numbers: list[float] = []
        self.dates = 0
        self.booleans = 0
        self.values: Counter[str] = Counter()

    def add(self, raw: str) -> None:
        self.count += 1
        value = raw.strip()
        if value.lower() in _MISSING:
            self.missing += 1
            return
        if len(self.values) < 100_000 or value in self.values:
            self.values[value] += 1
        number = _number(value)
        if number is not None:
            self.numbers.append(number)
            if number.is_integer() and "." not in value and "e" not in value.lower():
                self.integers += 1
        elif value.lower() in _BOOLEANS:
            self.booleans += 1
        elif _is_date(value):
            self.dates += 1

    @property
    def present(self) -> int:
        return self.count - self.missing

    def kind(self) -> str:
        present = self.present
        if present == 0:
            return "empty"
        if len(self.numbers) == present:
            return "integer" if self.integers == present else "number"
        if self.dates == present:
            return "date"
        if self.booleans == present:
            return "boolean"
        return "text"

    def summary(self, top: int) -> dict[str, Any]:
        kind = self.kind()
        out: dict[str, Any] = {
            "name": self.name,
            "type": kind,
            "missing": self.missing,
            "distinct": len(self.values),
        }
        if kind in ("integer", "number"):
            numbers = sorted(self.numbers)
            middle = len(numbers) // 2
            median = (
                numbers[middle] if len(numbers) % 2 else (numbers[middle - 1] + numbers[middle]) / 2
            )
            out.update(
                min=numbers[0],
                max=numbers[-1],
                mean=round(sum(numbers) / len(numbers), 6),
                median=median,
            )
        else:
            out["top"] = self.values.most_common(top)
            if kind == "text" and self.numbers and len(self.numbers) >= 0.8 * self.present:
                out["note"] = "mostly numeric: numbers stored as text?"
        distinct = len(self.values) == self.present
        if kind in ("text", "integer") and self.present >= 10 and distinct:
            out["note"] = "every value distinct: an identifier?"
        return out


def _sniff(sample: str) -> str:
    try:
        return csv.Sniffer().sniff(sample, delimiters=",;\t|").delimiter
    except csv.Error:
        return ","


def summarize(path: str, delimiter: str | None, top: int, has_header: bool) -> dict[str, Any]:
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as handle:
        sample = handle.read(64 * 1024)
        handle.seek(0)
        delimiter = delimiter or _sniff(sample)
        reader = csv.reader(handle, delimiter=delimiter)
        first = next(reader, None)
        if first is None:
            return {"file": path, "rows": 0, "columns": [], "delimiter": delimiter}
        names = first if has_header else [f"column_{i + 1}" for i in range(len(first))]
        columns = [Column(name or f"column_{i + 1}") for i, name in enumerate(names)]
        ragged = 0
        rows = 0
        for row in [first] if not has_header else []:
            rows += 1
            for column, value in zip(columns, row, strict=False):
                column.add(value)
        for row in reader:
            if not row:
                continue
            rows += 1
            if len(row) != len(columns):
                ragged += 1
            for column, value in zip(columns, row, strict=False):
                column.add(value)
            for column in columns[len(row) :]:
                column.add("")
    return {
        "file": path,
        "rows": rows,
        "header": has_header,
        "delimiter": delimiter,
        "ragged_rows": ragged,
        "columns": [column.summary(top) for column in columns],
    }


def _text(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['file']}: {summary['rows']} rows, {len(summary['columns'])} columns "
        f"(delimiter {summary['delimiter']!r}, header: {'yes' if summary.get('header') else 'no'})"
    ]
    if summary.get("ragged_rows"):
        lines.append(f"{summary['ragged_rows']} rows have a different number of fields")
    for column in summary["columns"]:
        line = f"- {column['name']}: {column['type']}, {column['missing']} missing"
        line += f", {column['distinct']} distinct"
        if "mean" in column:
            line += (
                f", min {column['min']:g}, max {column['max']:g}, "
                f"mean {column['mean']:g}, median {column['median']:g}"
            )
        elif column.get("top"):
            shown = ", ".join(f"{value!r} ({count})" for value, count in column["top"])
            line += f"; most common: {shown}"
        if "note" in column:
            line += f" [{column['note']}]"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarise a CSV file.")
    parser.add_argument("file")
    parser.add_argument("--delimiter", default=None)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--no-header", action="store_true", help="the first row is data")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.file, args.delimiter, max(1, args.top), not args.no_header)
    except OSError as exc:
        print(f"summarize.py: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else _text(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
