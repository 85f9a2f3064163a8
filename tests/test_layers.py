"""The package's layers, checked from the source: who may import whom.

    hotswap.workers, hotswap.cache, hotswap.profiles   import nothing of the orchestrator
    production modules                                 import nothing of hotswap.testing
    every module                                       sits in no import cycle (module level)
    every module                                       uses no private name of another module
    hotswap.tools                                      uses the public API (hotswap, profiles,
                                                       testing, fleet) and proctree's RSS reading
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hotswap"
PRODUCTION = ("hotswap.orchestrator", "hotswap.cache", "hotswap.workers", "hotswap.profiles")
BELOW_ORCHESTRATOR = ("hotswap.cache", "hotswap.workers", "hotswap.profiles")
TOOLS_MAY_USE = ("hotswap.tools", "hotswap.profiles", "hotswap.testing", "hotswap.errors",
                 "hotswap.workers.proctree", "hotswap.fleet")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.startswith("hotswap")}


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_production_modules_import_no_testing_hook() -> None:
    offenders = {name: sorted(i for i in _imports(path, top_level_only=False)
                              if _within(i, ("hotswap.testing",)))
                 for name, path in _modules().items() if _within(name, PRODUCTION)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_lower_layers_import_nothing_of_the_orchestrator() -> None:
    offenders = {name: sorted(i for i in _imports(path, top_level_only=False)
                              if _within(i, ("hotswap.orchestrator",)))
                 for name, path in _modules().items() if _within(name, BELOW_ORCHESTRATOR)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {name: {i for i in _imports(path, top_level_only=True) if i in modules and i != name}
             for name, path in modules.items()}
    for name in graph:  # a package's __init__ importing its own modules is not a cycle
        graph[name] = {i for i in graph[name] if not name.startswith(i + ".")}
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*trail[trail.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(path: Path, modules: set[str]) -> list[str]:
    """``from hotswap.x import _y``, and ``m._y`` where ``m`` names a hotswap module."""
    tree = ast.parse(path.read_text())
    bound: set[str] = set()  # local names of imported hotswap modules
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hotswap"):
            for alias in node.names:
                if _private(alias.name):
                    uses.append(f"{node.module}.{alias.name}")
                elif f"{node.module}.{alias.name}" in modules:
                    bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            bound.update(a.asname for a in node.names if a.asname and a.name in modules)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and _private(node.attr)):
            uses.append(f"{node.value.id}.{node.attr}")
    return uses


def test_no_module_uses_another_modules_private_names() -> None:
    modules = _modules()
    offenders = {name: uses for name, path in modules.items()
                 if (uses := _private_uses(path, set(modules)))}
    assert not offenders, offenders


def test_tools_are_built_on_the_public_api() -> None:
    offenders = {name: sorted(i for i in _imports(path, top_level_only=False)
                              if i != "hotswap" and i.split(".")[1] not in ("MODES", "testing")
                              and not _within(i, TOOLS_MAY_USE))
                 for name, path in _modules().items() if _within(name, ("hotswap.tools",))}
    assert not any(offenders.values()), offenders
