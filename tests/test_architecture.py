"""The module layering: no import cycle anywhere in ecomla, and nothing below the command line imports it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ecomla"


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
