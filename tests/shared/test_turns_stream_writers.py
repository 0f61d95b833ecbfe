"""The turns stream has one writer: ``turnqueue.queue_turn`` (#24).

A turn job is appended (a new turn, a hand-back, an answered question, a
retry, a lost Redis's recovery) only through it, so what a job carries and how
it is written is decided in one place. Found by reading the source: any
``xadd`` whose stream is a ``.turns`` attribute outside that function fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WRITER = ("shared/holdfast_shared/turnqueue.py", "queue_turn")


def _turn_appends(file: Path) -> list[tuple[str, str]]:
    """(file, enclosing function) of each ``….xadd(….turns, …)`` in ``file``."""
    found: list[tuple[str, str]] = []
    tree = ast.parse(file.read_text())
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "xadd"
                and node.args
                and isinstance(node.args[0], ast.Attribute)
                and node.args[0].attr == "turns"
            ):
                found.append((str(file.relative_to(ROOT)), function.name))
    return found


def test_only_queue_turn_appends_to_the_turns_stream() -> None:
    files = [*ROOT.glob("services/*/holdfast_*/**/*.py"), *ROOT.glob("shared/**/*.py")]
    appends = {append for file in files for append in _turn_appends(file)}
    assert appends == {WRITER}
