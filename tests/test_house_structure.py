"""Structure rules of issue 13 for the rooms split so far: no import cycle in the package (imports at module
level; TYPE_CHECKING blocks and imports inside functions are not edges), and in loading/, cli/ and formats.py
no module over 600 lines and no function over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "precision_audit"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
SPLIT = sorted([*(PACKAGE / "loading").glob("*.py"), *(PACKAGE / "cli").glob("*.py"), PACKAGE / "formats.py"])


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports at module level."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    deps: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            target = ".".join(p for p in (base, node.module or "") if p) if node.level else node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                deps.add(full if full in modules else target)
    return {d for d in deps if d in modules and d != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state and (found := visit(v)):
                return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state and (found := visit(u)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_import_graph_sees_relative_imports():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert "precision_audit.loading.model" in graph["precision_audit.loading.batch"]
    assert "precision_audit.cli.commands" in graph["precision_audit.cli.main"]
    assert "precision_audit.errors" in graph["precision_audit.formats"]


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


@pytest.mark.parametrize("path", SPLIT, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_function_sizes(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{path.name}: {text.count(chr(10))} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= MAX_FUNCTION_LINES, f"{path.name}: {node.name} has {lines} lines"
