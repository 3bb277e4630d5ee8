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
    """``cli_args`` imports only the package and its ground module ``config`` (which imports
    nothing of mcserve), so every CLI may import it without importing another."""
    assert all(t in ("mcserve", "mcserve.config") for t, _, _ in graph["mcserve.cli_args"])
    assert graph["mcserve.config"] == []


def test_ray_router_imports_nothing_of_mcserve(graph) -> None:
    """Ray pickles the router's module by value into every process that routes
    (``RequestRouterConfig``): it must stand on Ray and the standard library alone."""
    assert graph["mcserve.server.ray.router"] == []


# run in a fresh interpreter: imports each module in turn, and names the first after which
# torch is loaded
_TORCH_PROBE = """
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
    if "torch" in sys.modules:
        print(name)
        break
"""


def test_server_modules_import_no_torch() -> None:
    """Every module of ``mcserve.server`` imports without torch: ``protocol``, ``params``,
    ``state``, ``errors``, ``prompts``, ``shape``, ``streaming``, ``metrics``, ``middleware``,
    ``async_engine``, ``serving_chat``, ``serving_completion``, ``app``, ``cli_serve``, and the
    Ray scale-out package ``ray`` (``options``, ``router``, ``ingress``, ``replica``,
    ``metrics``, ``middleware``, ``deployment``; checked when Ray is installed).

    The server takes ``SamplingParams`` from the torch-free ``mcserve.engine.sampling_params``
    (``mcserve.engine.sampling``, the torch ``Sampler``, re-exports it) and the rest of the
    engine layer it imports at module level is torch-free too (``outputs``, ``prefix_keys``,
    ``tokenizer``). None of them is exempt: the ones that run the engine in-process import it
    (and so torch) inside the functions that build it, at run time: ``cli_serve.run_serve``
    (``LLMEngine``), ``ray.replica.MCServeEngine.__init__`` (torch, ``LLMEngine``) and the Ray
    ingress's start (``ray.ingress._model_dir``: ``DEFAULT_MODEL_DIR`` of ``llm_engine``).
    """
    import importlib.util
    import json
    import subprocess
    import sys

    names = [n for n in _modules() if _in(n, "mcserve.server")]
    assert {"mcserve.server.protocol", "mcserve.server.params", "mcserve.server.app",
            "mcserve.server.serving_chat", "mcserve.server.ray.ingress",
            "mcserve.server.ray.router"} <= set(names)
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        names = [n for n in names if not _in(n, "mcserve.server.ray")]
    out = subprocess.run([sys.executable, "-c", _TORCH_PROBE, json.dumps(names)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr
    culprit = out.stdout.strip()
    assert not culprit, f"importing {culprit} loads torch"
