"""The packages' boundaries: who may import whom, and no import cycles.

Services import ``shared``; ``shared`` imports no service; services never
import each other; the ``holdfast`` command (``src/holdfast``) imports
``shared`` and starts services by module name, never importing one; nothing
imports ``holdfast``. Within every package the modules import each other
without cycles — lazy imports inside functions included, since a cycle that
only works because one side imports late is still a knot.
"""

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
    "holdfast": ROOT / "src" / "holdfast",
}


def _imports(file: Path, package: str) -> set[str]:
    """Absolute names of the modules ``file`` imports (relative ones resolved)."""
    found: set[str] = set()
    module_parts = [package, *file.relative_to(PACKAGES[package]).with_suffix("").parts]
    if module_parts[-1] == "__init__":
        module_parts.pop()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module_parts[: len(module_parts) - node.level]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found |= {f"{prefix}.{alias.name}" for alias in node.names}
    return found


def _modules(package: str) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for file in PACKAGES[package].rglob("*.py"):
        parts = [package, *file.relative_to(PACKAGES[package]).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = file
    return out


def test_import_boundaries() -> None:
    for name in PACKAGES:
        imported = {
            module.split(".")[0]
            for file in _modules(name).values()
            for module in _imports(file, name)
        }
        imports = imported & set(PACKAGES)
        allowed = {name} if name == "holdfast_shared" else {name, "holdfast_shared"}
        assert imports <= allowed, f"{name} imports {sorted(imports - allowed)}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    # The shape of the old cli <-> supervisor knot.
    graph = {
        "h.cli": {"h.supervisor"},
        "h.supervisor": {"h.cli", "h.embedded"},
        "h.embedded": set(),
    }
    assert _find_cycle(graph) == ["h.cli", "h.supervisor", "h.cli"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    for name in PACKAGES:
        modules = _modules(name)
        graph = {
            module: {dep for dep in _imports(file, name) if dep in modules and dep != module}
            for module, file in modules.items()
        }
        # A package's __init__ re-exporting its modules is not a cycle with them.
        for deps in graph.values():
            deps.discard(name)
        cycle = _find_cycle(graph)
        assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
