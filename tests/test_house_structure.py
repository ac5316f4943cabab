"""Structure rules of issue 13 for the whole package (docs/architecture.md): no import cycle, no module over
600 lines, no function over 80 lines (data tables excepted, listed below with the reason).

The import graph counts every import the code names: at module level, inside functions (an import made when a
function runs closes a cycle just the same), inside ``if TYPE_CHECKING:`` (a type that names a later stage ties
the two as much as a call does: issue 34), and the package face's lazy table (precision_audit/__init__.py's
``_LAZY``, imported by name on first use); importing ``a.b.c`` also imports the packages ``a.b`` (their
``__init__``) that are not the importer's own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists()) / "precision_audit"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

#: Imports that close a cycle on purpose, each with the reason it stays.
ALLOWED_BACK_EDGES: dict[tuple[str, str], str] = {
    ("precision_audit.audit", "precision_audit"):
        "the callable module precision_audit.audit takes its class (_AuditModule) from the package's face, which "
        "hands the call to api.py, so that audit.py never imports api.py, which imports it; the face is loaded "
        "before any of its modules, so this edge never runs an import",
}

#: Module-level data tables that do not count towards a module's length, by (module, name), with the reason.
DATA_TABLES = {
    ("gpus.py", "GPUS"): "one GpuSpec row per target GPU with the source of every figure (docs/gpus.md); "
                         "splitting the table would not make it easier to read",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _lazy_imports(tree: ast.Module) -> set[str]:
    """The modules of the package face's ``_LAZY = {name: ".module"}`` table (imported by name on first use)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            return {f"precision_audit{v.value}" for v in node.value.values  # type: ignore[attr-defined]
                    if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return set()


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its code (``if TYPE_CHECKING:`` included)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text())
    deps: set[str] = _lazy_imports(tree) if name == "precision_audit" else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            target = ".".join(p for p in (base, node.module or "") if p) if node.level else node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                deps.add(full if full in modules else target)
    # the packages above a module are loaded before it: an implicit parent of the importer's own is no edge, but
    # a name taken from one (``from .. import __version__``) is an import of that package's __init__
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
    parents = {".".join(d.split(".")[:i]) for d in deps for i in range(1, d.count(".") + 1)} - own
    return {d for d in deps | parents if d in modules and d != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    for a, b in ALLOWED_BACK_EDGES:
        graph[a].discard(b)
    return graph


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


def test_the_import_graph_sees_relative_function_level_and_package_imports():
    graph = _graph()
    assert "precision_audit.loading.model" in graph["precision_audit.loading.batch"]
    assert "precision_audit.cli.commands" in graph["precision_audit.cli.main"]
    assert "precision_audit.errors" in graph["precision_audit.formats"]
    # inside a function (analysis/gemm_timing.py times GEMMs only when asked)
    assert "precision_audit.analysis.gemm_bench" in graph["precision_audit.analysis.gemm_timing"]
    # importing a module of another package runs that package's __init__ first
    assert "precision_audit.policy" in graph["precision_audit.runtime.apply"]
    # only inside `if TYPE_CHECKING:` (planning/build_policy.py's types from the analysis): an edge too
    assert "precision_audit.analysis.findings" in graph["precision_audit.planning.build_policy"]
    # the package face's lazy table
    assert {"precision_audit.audit", "precision_audit.runtime.api"} <= graph["precision_audit"]


def test_no_module_of_a_subpackage_imports_the_package_face():
    """Issue 34: the version is precision_audit/version.py's, so that no subpackage imports precision_audit/__init__
    (which imports every stage lazily: the import would close a circle through the face)."""
    graph = _graph()
    bad = sorted(m for m, deps in graph.items() if m.count(".") >= 2 and "precision_audit" in deps)
    assert not bad, bad


def test_every_allowed_back_edge_exists():
    modules = _modules()
    for a, b in ALLOWED_BACK_EDGES:
        assert b in _imports(a, modules[a], modules), f"{a} no longer imports {b}: drop it from ALLOWED_BACK_EDGES"


def test_no_import_cycle_in_the_package():
    graph = _graph()
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"


def _package_of(module: str) -> str:
    """``precision_audit.<pkg>`` for a module of a subpackage; a top-level module is its own node."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(_package_of(m), set()).update(_package_of(d) for d in deps)
    for p, deps in out.items():
        deps.discard(p)
    return out


def test_the_package_graph_collapses_modules_to_their_subpackage():
    g = _package_graph({"precision_audit.capture.noise": {"precision_audit.runtime.apply", "precision_audit.errors"},
                        "precision_audit.runtime.apply": {"precision_audit.runtime.fsdp"},
                        "precision_audit.runtime.fsdp": {"precision_audit.capture.stats"},
                        "precision_audit.capture.stats": set(), "precision_audit.errors": set()})
    assert g["precision_audit.capture"] == {"precision_audit.runtime", "precision_audit.errors"}
    assert g["precision_audit.runtime"] == {"precision_audit.capture"}  # its own modules are no edge
    assert _cycle(g) == ["precision_audit.capture", "precision_audit.runtime", "precision_audit.capture"]


def test_no_import_cycle_between_subpackages():
    """docs/architecture.md, "The packages, in data-flow order": the subpackages form no circle either (the module
    graph alone could be acyclic while, say, capture/ used runtime/ and runtime/ used capture/ through other
    modules)."""
    graph = _package_graph(_graph())
    assert _cycle(graph) is None, f"import cycle between packages: {' -> '.join(_cycle(graph) or [])}"


def _data_table_lines(name: str, tree: ast.Module) -> int:
    lines = 0
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and (name, t.id) in DATA_TABLES for t in targets):
            lines += node.end_lineno - node.lineno + 1
    return lines


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_and_function_sizes(path):
    text = path.read_text()
    tree = ast.parse(text)
    rel = str(path.relative_to(PACKAGE))
    lines = text.count("\n") - _data_table_lines(rel, tree)
    assert lines <= MAX_MODULE_LINES, f"{rel}: {lines} lines (data tables excepted)"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{rel}: {node.name} has {n} lines"


def test_every_listed_data_table_exists():
    for rel, name in DATA_TABLES:
        assert _data_table_lines(rel, ast.parse((PACKAGE / rel).read_text())) > 0, f"{rel}: no table {name}"


#: docs/architecture.md, "The rules that keep it this way": a stage imports the stages before it, never after.
NEVER_IMPORTS = {
    "capture": {"analysis", "planning", "report", "audit", "assemble", "api", "cli", "distributed", "verify"},
    "analysis": {"planning", "report", "audit", "assemble", "api", "cli", "verify"},
    "planning": {"report", "audit", "assemble", "api", "cli", "verify"},
    "report": {"capture", "planning", "audit", "api", "cli"},
    "policy": {"runtime", "audit", "capture", "analysis", "planning", "report"},
}


@pytest.mark.parametrize("stage", sorted(NEVER_IMPORTS))
def test_a_stage_never_imports_a_later_one(stage):
    graph = _graph()
    later = {f"precision_audit.{s}" for s in NEVER_IMPORTS[stage]}
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith(f"precision_audit.{stage}.")
                 or m == f"precision_audit.{stage}" for d in deps if ".".join(d.split(".")[:2]) in later)
    assert not bad, "\n".join(bad)


#: Test folders that mirror no package of precision_audit, and why.
TEST_FOLDERS_BEYOND_THE_PACKAGE = {
    "e2e": "whole audits of the sample and real-world models, through every stage",
    "gpu": "tests that need a CUDA device (a fake one everywhere, a real one when there is one; docs/gpu.md)",
}


def test_the_tests_mirror_the_package():
    tests = PACKAGE.parent / "tests"
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and any(p.rglob("test_*.py"))}
    assert folders - packages - set(TEST_FOLDERS_BEYOND_THE_PACKAGE) == set()
    # one module name per test file: the tests are imported by name (pytest's prepend mode, no __init__.py)
    names = [p.name for p in tests.rglob("*.py") if "golden" not in p.parts]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


#: docs/architecture.md, "The package map": each layer imports only the layers before it (and, in the first and the
#: last, its own neighbours); a name is a top-level module or a subpackage of precision_audit.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations", {"errors", "version", "formats", "options", "strict_json", "model_names", "host_rng",
                     "tf32_switches", "outputs", "gpus", "hardware", "record"}),
    ("policy", {"policy"}),
    ("runtime", {"runtime"}),
    ("emulation", {"emulation"}),
    ("load", {"loading"}),
    ("capture", {"capture"}),
    ("analysis", {"analysis"}),
    ("fp8, planning", {"fp8", "planning"}),
    ("report", {"report"}),
    ("setup, assembly", {"run_setup", "assemble"}),
    ("entry points", {"audit", "api", "verify", "export", "distributed", "integrations", "cli", "__init__",
                      "__main__"}),
]


def _layer_of(node: str) -> int:
    name = node.split(".")[1] if "." in node else "__init__"
    return next(i for i, (_, names) in enumerate(LAYERS) if name in names)


def test_every_module_has_a_layer():
    names = {n for _, ns in LAYERS for n in ns}
    found = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert found == names, f"not in LAYERS: {sorted(found - names)}; gone: {sorted(names - found)}"


def test_a_layer_imports_only_the_layers_before_it():
    graph = _package_graph(_graph())
    last = len(LAYERS) - 1
    bad = sorted(f"{a} ({LAYERS[_layer_of(a)][0]}) -> {b} ({LAYERS[_layer_of(b)][0]})"
                 for a, deps in graph.items() for b in deps
                 if _layer_of(b) > _layer_of(a) or (_layer_of(b) == _layer_of(a) not in (0, last)))
    assert not bad, "\n".join(bad)


#: The capture session's parts and the distributed audit's session, which must share state through declared objects
#: (capture/session_state.py, capture/ranks.py), never by reading another class's private names (issue 34).
PRIVATE_READ_SCOPE = [*sorted((PACKAGE / "capture").glob("*.py")), PACKAGE / "distributed" / "session.py"]

#: Underscore names of torch's own objects that capture reads, each with the reason: torch exposes no public spelling.
TORCH_PRIVATE_NAMES = {
    "_version": "a tensor's in-place version counter (how autograd itself tells a changed tensor)",
    "_base": "the tensor a view was made from",
    "_is_view": "whether a tensor is a view (torch has no public test)",
    "_buffers": "a module's buffer table, written back in place (capture/model_state.py)",
    "_schema": "an OpOverload's schema (mutability of its arguments)",
    "_C": "torch's C extension (the host allocator's empty_cache)",
    "_cast": "torch.amp.autocast_mode._cast, which the user-autocast tracker answers for (capture/user_autocast.py)",
}
#: Objects whose underscore attributes are names, not private state: aten's operators (``aten._to_copy``).
PUBLIC_NAMESPACES = {"_aten"}
#: The user-autocast tracker's marks on torch.autocast objects, set and read by its own patched methods
#: (capture/user_autocast.py): the object is those methods' ``self``.
OWN_MARK_PREFIX = "_pa_"


def _private_reads(path: Path) -> list[str]:
    """``x._name`` reads in ``path`` where ``x`` is not ``self``/``cls`` (``super()._name`` included: overriding a
    parent's private method is reaching into it), torch's names above apart."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.endswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and (owner.id in ("self", "cls") or owner.id in PUBLIC_NAMESPACES):
            continue
        if node.attr in TORCH_PRIVATE_NAMES or node.attr.startswith(OWN_MARK_PREFIX):
            continue
        out.append(f"{path.name}:{node.lineno}: {ast.unparse(owner)}.{node.attr}")
    return out


def test_the_private_read_finder_finds_them(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("class A(B):\n    def f(self, s, t):\n        self._own(cls._x, t._version, _aten._to_copy)\n"
                 "        return s._state, super()._hook(), s.calls._stack\n")
    found = [line.split(": ", 1)[1] for line in _private_reads(p)]
    assert sorted(found) == ["s._state", "s.calls._stack", "super()._hook"]


def test_no_capture_part_reads_another_class_private_names():
    bad = [line for path in PRIVATE_READ_SCOPE for line in _private_reads(path)]
    assert not bad, f"{len(bad)} reads of another object's private names:\n" + "\n".join(bad)
