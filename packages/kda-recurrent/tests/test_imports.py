"""Imports inside kda-core and kda-recurrent point one way: no module imports one that imports it back."""

from __future__ import annotations

import ast
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"kda_core": SRC / "kda-core" / "src" / "kda_core",
            "kda_recurrent": SRC / "kda-recurrent" / "src" / "kda_recurrent"}


def _module_graph():
    """module -> the modules of these packages it imports (at any depth of its code)."""
    graph = {}
    for root in PACKAGES.values():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root.parent).with_suffix("")
            name = ".".join(p for p in rel.parts if p != "__init__")
            deps = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        full = f"{node.module}.{alias.name}"
                        deps.add(full if any((r.parent / (full.replace(".", "/") + ".py")).exists()
                                             for r in PACKAGES.values()) else node.module)
                elif isinstance(node, ast.Import):
                    deps.update(alias.name for alias in node.names)
            graph[name] = {d for d in deps if d.split(".")[0] in PACKAGES and d != name}
    return graph


def _cycle(graph):
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


@pytest.mark.parametrize("pkg", sorted(PACKAGES))
def test_no_import_cycle_between_modules(pkg):
    graph = {n: {d for d in deps if not (n.startswith(d + ".") or d == n.rsplit(".", 1)[0])}
             for n, deps in _module_graph().items() if n.split(".")[0] == pkg}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
