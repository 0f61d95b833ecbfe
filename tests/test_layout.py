"""Services import ``shared``; ``shared`` imports no service; services never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "holdfast_shared": ROOT / "shared" / "holdfast_shared",
    "holdfast_gateway": ROOT / "services" / "gateway" / "holdfast_gateway",
    "holdfast_loop_worker": ROOT / "services" / "loop-worker" / "holdfast_loop_worker",
    "holdfast_tool_runner": ROOT / "services" / "tool-runner" / "holdfast_tool_runner",
    "holdfast_learning": ROOT / "services" / "learning" / "holdfast_learning",
}


def imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for file in path.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found


def test_import_boundaries() -> None:
    for name, path in PACKAGES.items():
        imports = imported_packages(path) & (set(PACKAGES) | {"holdfast"})
        allowed = {name} if name == "holdfast_shared" else {name, "holdfast_shared"}
        assert imports <= allowed, f"{name} imports {sorted(imports - allowed)}"
