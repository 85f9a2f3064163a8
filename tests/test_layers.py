"""The package's layers, checked from the source: who may import whom.

Every import counts: at module level and inside functions, absolute and relative (an ``if
TYPE_CHECKING:`` block aside: it never runs). ``hotswap.x.y.Name`` is an import of the module
``hotswap.x.y``. A module importing a package it sits in (``hotswap`` itself included) is no
edge: a package's ``__init__`` re-exports its modules, and ``import hotswap`` inside a
function reaches the public API when it is called.

    layer 13 hotswap (the package: the public API)  hotswap.cli  hotswap.tools
    layer 12 hotswap.fleet (cluster: names kept, preload, metrics)  hotswap.testing
    layer 11 hotswap.engine (api, coordinator, runtime: the backend's top)
    layer 10 hotswap.engine.policy (ladder, gate, fleet vote)
    layer 9  hotswap.engine.sources (cache, background worker, in-process, local)
    layer 8  hotswap.engine.graph, journey, recording, served (one graph's runner and state)
    layer 7  hotswap.jobs (what runs inside a worker)
    layer 6  hotswap.engine.loading
    layer 5  hotswap.engine.shipping
    layer 4  hotswap.engine.options
    layer 3  hotswap.executors (the Dask one too: the registry imports it by name)
    layer 2  hotswap.fleet.store  hotswap.compat  hotswap.engine.threads
    layer 1  hotswap.workers  hotswap.system  hotswap.cache  hotswap.profiles
    layer 0  hotswap.errors  hotswap.settings  hotswap.plugins  hotswap.counters
    every module                         sits in a layer (its unit: the longest name listed in
                                         LAYERS that it is or sits in) and imports only from
                                         its layer or below
    every module                         sits in no import cycle
    hotswap.workers, cache, profiles     import nothing of the engine
    every module but testing/tools/cli   imports nothing of hotswap.testing
    every module                         uses no private name of another module
    hotswap.tools                        uses the public API (hotswap, profiles, testing,
                                         fleet) and proctree's RSS reading
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hotswap"
ROOT = "hotswap"
LAYERS: dict[str, int] = {
    "hotswap.errors": 0, "hotswap.settings": 0, "hotswap.plugins": 0, "hotswap.counting": 0,
    "hotswap.workers": 1, "hotswap.system": 1, "hotswap.cache": 1, "hotswap.profiles": 1,
    "hotswap.fleet.store": 2, "hotswap.compat": 2, "hotswap.engine.threads": 2,
    "hotswap.executors": 3, "hotswap.service": 3,
    "hotswap.engine.options": 4,
    "hotswap.engine.shipping": 5,
    "hotswap.engine.loading": 6,
    "hotswap.jobs": 7,
    "hotswap.engine.graph": 8, "hotswap.engine.journey": 8, "hotswap.engine.recording": 8,
    "hotswap.engine.served": 8,
    "hotswap.engine.sources": 9,
    "hotswap.engine.policy": 10,
    "hotswap.engine": 11,
    "hotswap.fleet": 12, "hotswap.testing": 12,
    ROOT: 13, "hotswap.cli": 13, "hotswap.tools": 13,
}

NOT_PRODUCTION = ("hotswap.testing", "hotswap.tools", "hotswap.cli")
TOOLS_MAY_USE = ("hotswap.tools", "hotswap.profiles", "hotswap.testing", "hotswap.errors",
                 "hotswap.system.proctree", "hotswap.fleet")


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _from_module(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from (relative ones resolved)."""
    if not node.level:
        return node.module or ""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = here.split(".")[: len(here.split(".")) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def _typing_only(tree: ast.AST) -> set[int]:
    return {id(n) for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
            for child in node.body for n in ast.walk(child)}


def imports(name: str, path: Path, known: dict[str, Path]) -> dict[str, list[int]]:
    """The hotswap modules ``name`` imports -> the lines importing each."""
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
    found: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(name, path, node)
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # hotswap.x.y.Name -> hotswap.x.y
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.setdefault(target, []).append(node.lineno)
    return found


def graph() -> dict[str, dict[str, list[int]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def unit(name: str) -> str | None:
    """The longest name in LAYERS that ``name`` is or sits in (the package root only as
    itself, so that a new top-level module needs a layer of its own)."""
    if name == ROOT:
        return ROOT
    listed = [u for u in LAYERS if u != ROOT and (name == u or name.startswith(u + "."))]
    return max(listed, key=len, default=None)


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _where(name: str, lines: list[int]) -> str:
    path = modules()[name].relative_to(PACKAGE.parent)
    return f"{path}:{','.join(map(str, sorted(set(lines))))}"


def test_the_graph_sees_nested_and_relative_imports(tmp_path: Path) -> None:
    (tmp_path / "hotswap" / "x").mkdir(parents=True)
    for name in ("__init__", "a", "b", "x/__init__", "x/c"):
        (tmp_path / "hotswap" / f"{name}.py").touch()
    (tmp_path / "hotswap" / "x" / "c.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from .. import a\n"
        "if TYPE_CHECKING:\n    from hotswap import b\n"
        "def f():\n    from hotswap.b import Name\n")
    known = {"hotswap": Path(), "hotswap.a": Path(), "hotswap.b": Path(), "hotswap.x": Path(),
             "hotswap.x.c": Path()}
    assert imports("hotswap.x.c", tmp_path / "hotswap" / "x" / "c.py", known) == {
        "hotswap.a": [2], "hotswap.b": [6]}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    found = graph()
    components = cycles({name: set(targets) for name, targets in found.items()})
    report = [f"cycle of {len(c)}: " + "\n    ".join(
        [" ".join(c), *sorted(f"{a} -> {b}  ({_where(a, found[a][b])})"
                              for a in c for b in found[a] if b in c)])
        for c in components]
    assert not report, "\n".join(report)


def test_every_module_has_a_layer() -> None:
    assert sorted(name for name in modules() if unit(name) is None) == []


def test_imports_flow_down() -> None:
    found = graph()
    upward = {(a, b): _where(a, lines) for a, targets in found.items()
              for b, lines in targets.items()
              if (ua := unit(a)) and (ub := unit(b)) and LAYERS[ub] > LAYERS[ua]}
    assert upward == {}


def test_production_modules_import_no_testing_hook() -> None:
    offenders = {name: sorted(t for t in targets if _within(t, ("hotswap.testing",)))
                 for name, targets in graph().items() if not _within(name, NOT_PRODUCTION)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_lower_layers_import_nothing_of_the_engine() -> None:
    below = ("hotswap.workers", "hotswap.system", "hotswap.cache", "hotswap.profiles",
             "hotswap.executors", "hotswap.fleet.store", "hotswap.compat")
    offenders = {name: sorted(t for t in targets if _within(t, ("hotswap.engine",)))
                 for name, targets in graph().items() if _within(name, below)}
    assert {k: v for k, v in offenders.items() if v} == {}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(name: str, path: Path, known: set[str]) -> list[str]:
    """``from hotswap.x import _y`` (or ``from .x import _y``), and ``m._y`` where ``m`` names
    a hotswap module."""
    tree = ast.parse(path.read_text())
    bound: set[str] = set()  # local names of imported hotswap modules
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _from_module(name, path, node)
            if not _within(module, (ROOT,)):
                continue
            for alias in node.names:
                if _private(alias.name):
                    uses.append(f"{module}.{alias.name}")
                elif f"{module}.{alias.name}" in known:
                    bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            bound.update(a.asname for a in node.names if a.asname and a.name in known)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and _private(node.attr)):
            uses.append(f"{node.value.id}.{node.attr}")
    return uses


def test_no_module_uses_another_modules_private_names() -> None:
    known = modules()
    offenders = {name: uses for name, path in known.items()
                 if (uses := _private_uses(name, path, set(known)))}
    assert not offenders, offenders


def test_tools_are_built_on_the_public_api() -> None:
    offenders = {name: sorted(t for t in targets if not _within(t, TOOLS_MAY_USE))
                 for name, targets in graph().items() if _within(name, ("hotswap.tools",))}
    assert not any(offenders.values()), offenders
