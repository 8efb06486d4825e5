"""The agent package has no import circle (``TYPE_CHECKING`` imports count): each module's
imports, read with ``ast``, form a graph without cycles."""

from __future__ import annotations

import ast
import os

import elasticstore.agent

AGENT = os.path.dirname(os.path.abspath(elasticstore.agent.__file__))


def _imports() -> dict[str, set[str]]:
    """module -> the modules of the agent package it imports (relative imports only: the
    package imports itself no other way)."""
    names = {f[:-3] for f in os.listdir(AGENT) if f.endswith(".py") and f != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name in names:
        with open(os.path.join(AGENT, name + ".py")) as f:
            tree = ast.parse(f.read())
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
        graph[name] = found & names - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def test_the_agent_package_has_no_import_circle() -> None:
    graph = _imports()
    assert "health" in graph["agent"] and "agent" not in graph["health"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_a_circle_is_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
