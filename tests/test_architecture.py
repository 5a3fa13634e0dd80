"""The module layering that docs/architecture.md draws: every import goes down (or stays in its layer), no import
cycle anywhere in ecomla, and nothing below the command line imports it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ecomla"


def module_imports() -> dict[str, set[str]]:
    """ecomla module -> the ecomla modules it imports, at the top of the file or inside a function."""
    files = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def resolve(name: str) -> str | None:  # a module, or the package that holds the imported name
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, f in files.items():
        found = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ecomla":
                found |= {resolve(f"{node.module}.{a.name}") for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {resolve(a.name) for a in node.names if a.name.split(".")[0] == "ecomla"}
        graph[module] = found - {None, module, "ecomla"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle():
    graph = module_imports()
    assert "ecomla.convert.stream" in graph and graph["ecomla.cli"]  # the walk sees the package
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_entry_point_imports_the_command_line():
    importers = sorted(m for m, deps in module_imports().items() if "ecomla.cli" in deps)
    assert importers == ["ecomla.__main__"]  # the launchers (ecomla.distill, ecomla.run) build their own


# docs/architecture.md's layers, top to bottom, by top-level subpackage or module of ecomla
LAYERS = {
    "entry points": ["ecomla", "ecomla.cli", "ecomla.__main__", "ecomla.distill.__main__", "ecomla.run.__main__",
                     "ecomla.recipe.command"],
    "jobs": ["run", "variants", "analyze", "export", "fetch", "sample", "average", "build"],
    "pipelines": ["convert", "distill", "eval"],
    "math, models": ["mla", "lrkv", "decode"],
    "foundations": ["recipe", "io", "data", "tinyworld", "pytext", "compat", "errors"],
}


def layer_of(module: str) -> int:
    """0 for the entry points, growing downward; a module's own entry wins over its subpackage's."""
    for i, names in enumerate(LAYERS.values()):
        if module in names:
            return i
    for i, names in enumerate(LAYERS.values()):
        if module.split(".")[1] in names:
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS (and of docs/architecture.md); add it")


def test_every_import_goes_down_a_layer_or_stays():
    up = [f"{m} ({list(LAYERS)[layer_of(m)]}) imports {d} ({list(LAYERS)[layer_of(d)]})"
          for m, deps in sorted(module_imports().items()) for d in sorted(deps) if layer_of(d) < layer_of(m)]
    assert up == []


def test_the_layer_check_sees_an_import_that_goes_up():
    assert layer_of("ecomla.pytext.tasks") > layer_of("ecomla.eval.runner") > layer_of("ecomla.run.pipeline")
    assert layer_of("ecomla.recipe.command") == 0 and layer_of("ecomla.recipe.schema") == 4


def test_scripts_hold_only_entry_points_and_benchmarks():
    """scripts/: shell entry points and bench_*.py; builders of committed data live in the package (`ecomla
    build`), experiments are `ecomla run` recipes, and no script imports another or edits sys.path."""
    scripts = ROOT / "scripts"
    odd = [p.name for p in scripts.iterdir() if p.is_file() and not (p.suffix == ".sh" or
                                                                    (p.name.startswith("bench_") and p.suffix == ".py"))]
    assert odd == []
    names = {p.stem for p in scripts.glob("*.py")}
    for path in scripts.glob("*.py"):
        text = path.read_text()
        assert "sys.path" not in text, path.name
        imported = set(re.findall(r"^\s*(?:from|import)\s+(\w+)", text, flags=re.M))
        assert not imported & names, (path.name, imported & names)
