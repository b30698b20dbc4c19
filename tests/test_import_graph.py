"""The gateway's modules import each other without a cycle, type-only imports
included: each one can be read (and loaded) on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import redbatch.api

PACKAGE = "redbatch.api"


def _modules() -> dict[str, Path]:
    root = Path(redbatch.api.__file__).parent
    return {(PACKAGE if p.stem == "__init__" else f"{PACKAGE}.{p.stem}"): p
            for p in root.glob("*.py")}


def _imported(node: ast.AST, modules: set[str]) -> set[str]:
    """The package's modules that one import statement names (``from redbatch.api
    import body`` names ``redbatch.api.body``)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names} & modules
    if not isinstance(node, ast.ImportFrom) or node.module is None or node.level:
        return set()
    named = {f"{node.module}.{a.name}" for a in node.names} & modules
    return named or ({node.module} & modules)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in it (TYPE_CHECKING too)."""
    modules = _modules()
    names = set(modules)
    return {name: {m for node in ast.walk(ast.parse(path.read_text()))
                   for m in _imported(node, names)} - {name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order), or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


def test_find_cycle_finds_a_type_only_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_gateway_modules_import_without_a_cycle() -> None:
    graph = import_graph()
    assert {"redbatch.api.core", "redbatch.api.gateway", "redbatch.api.v2"} <= set(graph)
    assert "redbatch.api.gateway" in graph["redbatch.api.v2"]  # TYPE_CHECKING counted
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
