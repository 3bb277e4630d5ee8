"""The package's layers, checked on the source (``ast``, nothing imported):

    kernels  <-  models  <-  engine  <-  server

a layer never imports one to its right, and no two of mcserve's modules import each other, even
through a chain (the import graph is acyclic). Imports inside functions count: a lazy import is
still a dependency. Imports under ``if TYPE_CHECKING:`` count for the layers but not for cycles
(they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mcserve"

# layer -> the packages it must not import
FORBIDDEN = {
    "mcserve.kernels": ("mcserve.models", "mcserve.engine", "mcserve.server"),
    "mcserve.models": ("mcserve.engine", "mcserve.server"),
    "mcserve.engine": ("mcserve.server",),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported mcserve module, line, runs at runtime) for every import statement of the
    module, at any depth (functions, classes, try blocks)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    out: list[tuple[str, int, bool]] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".")
        base = base if is_package else base[:-1]
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, runtime: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, False)
            for child in node.orelse:
                visit(child, runtime)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "mcserve" or alias.name.startswith("mcserve."):
                    out.append((alias.name, node.lineno, runtime))
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node)
            if base == "mcserve" or base.startswith("mcserve."):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    out.append((sub if sub in modules else base, node.lineno, runtime))
        for child in ast.iter_child_nodes(node):
            visit(child, runtime)

    visit(tree, True)
    return out


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int, bool]]]:
    modules = _modules()
    assert "mcserve.engine.llm_engine" in modules and "mcserve.kernels" in modules
    return {name: _imports(name, path, modules) for name, path in modules.items()}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_downwards(graph, layer: str) -> None:
    bad = [f"{mod}:{line} imports {target}"
           for mod, edges in sorted(graph.items()) if _in(mod, layer)
           for target, line, _ in edges
           if any(_in(target, f) for f in FORBIDDEN[layer])]
    assert not bad, f"{layer} must not import {', '.join(FORBIDDEN[layer])}:\n" + "\n".join(bad)


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle (``[a, b, ..., a]``) of the directed graph, or None (iterative DFS)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(edges, WHITE)
    for start in sorted(edges):
        if color[start] != WHITE:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(edges[start]))]
        path = [start]
        color[start] = GREY
        while stack:
            node, todo = stack[-1]
            if not todo:
                stack.pop()
                path.pop()
                color[node] = BLACK
                continue
            nxt = todo.pop(0)
            if color.get(nxt, BLACK) == GREY:
                return path[path.index(nxt):] + [nxt]
            if color.get(nxt) == WHITE:
                color[nxt] = GREY
                path.append(nxt)
                stack.append((nxt, sorted(edges[nxt])))
    return None


def test_no_import_cycles(graph) -> None:
    edges = {mod: {t for t, _, runtime in e if runtime and t in graph and t != mod}
             for mod, e in graph.items()}
    cycle = _find_cycle(edges)
    if cycle is not None:
        lines = {(mod, t): line for mod, e in graph.items() for t, line, _ in e}
        steps = [f"  {a} (line {lines[a, b]}) -> {b}" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle among mcserve's modules:\n" + "\n".join(steps))


def test_cycle_finder_finds_cycles() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) in (
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"])
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_shared_cli_module_imports_no_subpackage(graph) -> None:
    assert all(t == "mcserve" for t, _, _ in graph["mcserve.cli_args"])
