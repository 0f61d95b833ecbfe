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
import contextlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "holdfast_shared": ROOT / "shared" / "holdfast_shared",
    "holdfast_gateway": ROOT / "services" / "gateway" / "holdfast_gateway",
    "holdfast_loop_worker": ROOT / "services" / "loop-worker" / "holdfast_loop_worker",
    "holdfast_tool_runner": ROOT / "services" / "tool-runner" / "holdfast_tool_runner",
    "holdfast_learning": ROOT / "services" / "learning" / "holdfast_learning",
    "holdfast": ROOT / "src" / "holdfast",
}


def _parse(source: str) -> ast.Module:
    # CPython 3.11 can raise a spurious "AST constructor recursion depth
    # mismatch" while other threads run (python/cpython#106905; seen on 3.11.7
    # in the embedded-servers run): the pytest worker has threads of other tests.
    for _ in range(2):
        with contextlib.suppress(SystemError):
            return ast.parse(source)
    return ast.parse(source)


def _imports(file: Path, package: str) -> set[str]:
    """Absolute names of the modules ``file`` imports (relative ones resolved)."""
    found: set[str] = set()
    module_parts = [package, *file.relative_to(PACKAGES[package]).with_suffix("").parts]
    if module_parts[-1] == "__init__":
        module_parts.pop()
    for node in ast.walk(_parse(file.read_text())):
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


# Who uses ``shared``: the four services and the ``holdfast`` command (which
# creates API keys and migrates the database without starting a service).
CONSUMERS = [name for name in PACKAGES if name != "holdfast_shared"]

# ``shared`` modules that fewer than two consumers import, and why they stay.
# Everything else one consumer uses belongs in that consumer.
SINGLE_USE_ALLOWED = {
    # Alembic loads the migrations by path (``db/migrate.py``), never by import.
    "holdfast_shared.db.migrations": "run by Alembic",
    # The registry imports a provider's module by its name from the model spec,
    # so no import statement names them; the loop-worker and learning run them.
    "holdfast_shared.providers.anthropic": "loaded by name (providers/registry.py)",
    # A built-in skill's script: copied into the sandbox and run there.
    "holdfast_shared.skills.builtin": "a skill's files, run in the sandbox",
    # The schema's migrations stay beside the models they migrate; the holdfast
    # command runs them (``holdfast migrate``, compose's migrate step, every image).
    "holdfast_shared.db.migrate": "run by the holdfast command, with the models",
}


def _resolve(module: str, name: str | None, modules: dict[str, Path]) -> str | None:
    """The ``shared`` module that defines what ``from module import name`` (or
    ``import module``) brings in: a package's re-export is followed to its source."""
    if name is not None and f"{module}.{name}" in modules:
        return f"{module}.{name}"
    if module not in modules:
        return None
    if name is None or modules[module].name != "__init__.py":
        return module
    for node in ast.walk(ast.parse(modules[module].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if any((alias.asname or alias.name) == name for alias in node.names):
                return _resolve(node.module, name, modules) or module
    return module


def _shared_uses(file: Path, package: str, modules: dict[str, Path]) -> set[str]:
    """The ``shared`` modules ``file`` uses, re-exports followed to their source."""
    module_parts = [package, *file.relative_to(PACKAGES[package]).with_suffix("").parts]
    if module_parts[-1] == "__init__":
        module_parts.pop()
    found: set[str] = set()
    for node in ast.walk(_parse(file.read_text())):
        if isinstance(node, ast.Import):
            found |= {r for a in node.names if (r := _resolve(a.name, None, modules))}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module_parts[: len(module_parts) - node.level]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found |= {r for a in node.names if (r := _resolve(prefix, a.name, modules))}
    return found


def _consumers_of_shared() -> dict[str, set[str]]:
    """Each ``shared`` module's consumers: those importing it, or a ``shared``
    module that does (transitively)."""
    modules = _modules("holdfast_shared")
    needs = {
        module: _shared_uses(file, "holdfast_shared", modules) - {module}
        for module, file in modules.items()
    }
    users: dict[str, set[str]] = {module: set() for module in modules}
    for consumer in CONSUMERS:
        todo = [m for f in _modules(consumer).values() for m in _shared_uses(f, consumer, modules)]
        seen: set[str] = set()
        while todo:
            if (module := todo.pop()) not in seen:
                seen.add(module)
                todo += needs[module]
        for module in seen:
            users[module].add(consumer)
    return users


def test_shared_holds_what_two_consumers_use() -> None:
    users = _consumers_of_shared()
    allowed = {
        module
        for module in users
        if any(module == a or module.startswith(a + ".") for a in SINGLE_USE_ALLOWED)
    }
    modules = _modules("holdfast_shared")
    # A package's __init__ only names its modules; they are judged one by one.
    packages = {m for m, f in modules.items() if f.name == "__init__.py"}
    single = {
        m: sorted(u)
        for m, u in users.items()
        if len(u) < 2 and m not in allowed and m not in packages
    }
    assert not single, (
        "shared modules fewer than two packages use (move each into its user, or "
        f"allow it in SINGLE_USE_ALLOWED with the reason): {single}"
    )
    assert len(users["holdfast_shared.keys"]) >= 2, "the check sees no imports"


def test_the_shared_check_follows_reexports() -> None:
    users = _consumers_of_shared()
    # The gateway names Brain through the package (``holdfast_shared.memory``); the
    # check must credit the module that defines it.
    assert "holdfast_gateway" in users["holdfast_shared.memory.brain"]
