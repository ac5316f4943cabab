"""Hostile policies through ``precision-audit export`` (issue 11, class 1: code injection).

Every string of a policy (model class, target name, module names, reasons) and the policy path reach the
exported file only as ``repr()`` / ``json.dumps``. What is checked, for each target:

- the Python compiles, and its syntax tree is the tree exported for a *twin* policy of the same shape whose
  strings are harmless placeholders (so no policy string became code, a statement, or a docstring's end);
  the two files have the same number of lines and the same lines are comments (no string escaped a comment);
- run in a subprocess (``python -I``) in an empty scratch folder, with torch / lightning / accelerate /
  precision_audit replaced by recording stand-ins at import, it creates no file, prints nothing, and calls
  ``load_policy`` with exactly the policy path;
- the DeepSpeed JSON parses back to the same strings;
- through the CLI: exit 0, the notes on stderr hold no raw control character, no traceback.

``CASES`` (table-driven, hand-made payloads) is part of the bad-input catalogue (tests/cli/test_bad_inputs.py);
the hypothesis test draws arbitrary Unicode (surrogates, line and paragraph separators, quotes, backslashes)
for every string field.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_audit.cli import main
from precision_audit.export import export_policy
from precision_audit.policy import LossScaling, ModuleOverride, Policy, save_policy

PY_TARGETS = ("lightning", "accelerate", "fsdp", "torchao", "torchtitan")
FP = "sha256:" + "0" * 64

# Runs exported files with stand-ins for the libraries they import; prints one JSON line (the load_policy
# calls) after them, so anything the exported code printed shows up before it.
RUNNER = r'''
import importlib.abc, importlib.machinery, json, sys, types
ROOTS = {"torch", "torchao", "torchtitan", "lightning", "accelerate", "precision_audit"}
calls = []

class Stub:
    def __init__(self, name):
        object.__setattr__(self, "_name", name)
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return Stub(self._name + "." + k)
    def __setattr__(self, k, v):
        pass
    def __mro_entries__(self, bases):  # a class of the generated code subclassing a stubbed one
        return (object,)
    def __call__(self, *a, **kw):
        if self._name == "precision_audit.load_policy":
            calls.append(list(a))
        return Stub(self._name + "()")

class StubModule(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return Stub(self.__name__ + "." + k)

class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None
    def create_module(self, spec):
        return StubModule(spec.name)
    def exec_module(self, module):
        module.__path__ = []

sys.meta_path.insert(0, Finder())
for path in sys.argv[1:]:
    for root in list(sys.modules):
        if root.split(".")[0] in ROOTS:
            del sys.modules[root]
    with open(path, "rb") as f:  # bytes, as python reads a file: an encoding declaration applies
        source = f.read()
    exec(compile(source, path, "exec"), {"__name__": "exported"})
print(json.dumps({"load_policy": calls}))
'''


def make_policy(model_class: str = "Net", target: str = "H100 SXM", default: str = "fp16",
                modules: dict[str, tuple[str, str]] | None = None) -> Policy:
    return Policy(model_class=model_class, model_fingerprint=FP, model_modules=3, target_name=target,
                  target_compute_capability=(9, 0), default_format=default,
                  modules={n: ModuleOverride(f, r) for n, (f, r) in (modules or {}).items()},
                  loss_scaling=LossScaling(enabled=default == "fp16"))


def twin(policy: Policy) -> Policy:
    """The same shape (formats, nesting of module names, which reasons are empty) with harmless strings."""
    comps: dict[str, str] = {}

    def name(n: str) -> str:
        if n == "":
            return ""
        return ".".join(comps.setdefault(c, f"c{len(comps)}") for c in n.split("."))

    return dataclasses.replace(
        policy, model_class="M", target_name="T",
        modules={name(n): ModuleOverride(o.format, "r" if o.reason else "") for n, o in policy.modules.items()})


class _Normalise(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return ast.Constant("S") if isinstance(node.value, str) else node

    def visit_Dict(self, node: ast.Dict) -> ast.Dict:
        self.generic_visit(node)
        items = sorted(zip(node.keys, node.values), key=lambda kv: ast.dump(kv[0]) + ast.dump(kv[1]))
        return ast.Dict(keys=[k for k, _ in items], values=[v for _, v in items])


def shape(text: str) -> tuple[str, list[bool]]:
    """The syntax tree with every string replaced by "S" (dict items sorted), and which lines are comments."""
    tree = _Normalise().visit(ast.parse(text.encode("utf-8")))  # bytes: an encoding declaration applies
    return ast.dump(tree), [line.lstrip().startswith("#") for line in text.split("\n")]


def run_exported(paths: list[Path]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs the files in an empty scratch folder; returns the process and what the folder holds after."""
    with tempfile.TemporaryDirectory(prefix="pa-export-run-") as scratch:
        proc = subprocess.run([sys.executable, "-I", "-c", RUNNER, *map(str, paths)], cwd=scratch,
                              capture_output=True, text=True, timeout=60)
        return proc, sorted(os.listdir(scratch))


def check_exports(policy: Policy, policy_path: str, folder: Path) -> None:
    """Every check of the module docstring for one policy and path, all four targets."""
    reference = twin(policy)
    files = []
    for target in PY_TARGETS:
        out = export_policy(policy, target, policy_path=policy_path)
        ref = export_policy(reference, target, policy_path="policy.json")
        compile(out.text.encode("utf-8"), f"<{target}>", "exec")
        got_tree, got_comments = shape(out.text)
        ref_tree, ref_comments = shape(ref.text)
        assert got_tree == ref_tree, f"{target}: a policy string changed the code\n{out.text}"
        assert got_comments == ref_comments, f"{target}: a policy string broke out of a comment\n{out.text}"
        assert out.text.encode("utf-8")  # no lone surrogate reaches the file
        path = folder / f"{target}.py"
        path.write_text(out.text, encoding="utf-8")
        files.append(path)
    proc, left = run_exported(files)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"the exported code printed something:\n{proc.stdout}"
    # lightning, accelerate and fsdp load the policy for its per-module part; torchao and torchtitan do not
    assert json.loads(lines[0]) == {"load_policy": [[policy_path]] * 3}
    assert left == [], f"running the exported code created {left}"
    ds = json.loads(export_policy(policy, "deepspeed", policy_path=policy_path).text)["precision_audit"]
    assert (ds["model"], ds["target"], ds["exported_from"]) == (policy.model_class, policy.target_name, policy_path)
    assert ds["modules"] == {n: {"format": o.format, "reason": o.reason} for n, o in policy.modules.items() if n}


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------

INJECT = "\nopen('pwned', 'w').write('x'); print('pwned')\n"


@dataclasses.dataclass(frozen=True)
class Case:
    """A hostile policy exported through the CLI. ``code`` 0: a valid policy whose strings must stay inert;
    2: an invalid policy or option, refused with one message naming ``words``."""

    id: str
    policy: dict
    words: tuple[str, ...] = ()
    code: int = 0
    target: str = "fsdp"
    path_name: str = "policy.json"


def _doc(**over) -> dict:
    d = make_policy(modules={"enc.fc": ("fp32", "overflow"), "head": ("bf16", "")}).to_dict()
    for k, v in over.items():
        section, _, key = k.partition("__")
        if key:
            d[section][key] = v
        else:
            d[section] = v
    return d


def _layout_doc(matching: bool) -> dict:
    """A policy whose model.layout names a module with a lone surrogate (JSON's "\\ud800"), its fingerprint the
    layout's own (``matching``) or another's (a hand-edited file)."""
    import hashlib

    layout = {"": "Net[]", "enc\ud800": "Linear[weight:32x32,bias:32]", "head": "Linear[weight:8x32,bias:8]"}
    h = hashlib.sha256()  # the fingerprint's definition (policy/schema.py), each line's bytes as UTF-8 would be
    for name, entry in layout.items():
        kind, _, rest = entry.partition("[")
        h.update(f"{name}\t{kind}\t{rest[:-1]}\n".encode("utf-8", "surrogatepass"))
    d = _doc()
    d["model"]["layout"] = layout
    d["model"]["fingerprint"] = "sha256:" + h.hexdigest() if matching else FP
    d["fp8"] = {"modules": {"enc\ud800": {"recipe": "fp8_rowwise", "reason": "r"}}}
    return d


CASES = [
    Case("export-model-class-newline-statement", _doc(model__class="Net" + INJECT)),
    Case("export-target-newline-statement", _doc(target__name="H100" + INJECT), target="lightning"),
    Case("export-module-name-newline", _doc(modules={"a" + INJECT: {"format": "fp32", "reason": ""}})),
    Case("export-reason-closes-docstring",
         _doc(modules={"fc": {"format": "fp32", "reason": '"""' + INJECT + '"""'}}), target="accelerate"),
    Case("export-name-closes-docstring-single-quotes",
         _doc(modules={"fc'''" + INJECT: {"format": "bf16", "reason": "'''"}}), target="lightning"),
    Case("export-carriage-return", _doc(model__class="Net\rprint('pwned')", target__name="T\r\nprint(1)")),
    Case("export-unicode-line-separators",
         _doc(model__class="A\u2028print(1)\u2029\x0b\x0c\x85", modules={"b\u2028c": {"format": "fp32"}}),
         target="accelerate"),
    # Python reads an encoding declaration in a comment on line 1 or 2 (PEP 263); in UTF-7, "+AAo-" is "\n".
    Case("export-encoding-declaration-utf7",
         _doc(model__class="x coding: utf-7 +AAo-open('pwned', 'w').close()+AAo-#",
              target__name="# vim: set fileencoding=utf-7 :"), target="lightning"),
    Case("export-lone-surrogates", _doc(model__class="\ud800", modules={"\udfff.x": {"format": "fp16",
                                                                                       "reason": "\udc80"}})),
    Case("export-backslash-at-line-end", _doc(model__class="Net\\", target__name="\\",
                                              modules={"fc\\": {"format": "fp32", "reason": "\\"}})),
    Case("export-nul-and-bidi", _doc(model__class="N\x00et\u202e)(tnirp", modules={"\u202efc": {"format": "fp32"}}),
         target="accelerate"),
    Case("export-ansi-escape-on-stderr", _doc(modules={"\x1b[2J\x1b[31mfc": {"format": "fp32",
                                                                             "reason": "\x1b]0;title\x07"}}),
         target="deepspeed"),
    Case("export-path-with-newline-and-quotes", _doc(), target="lightning", path_name="p'\n\"q\\.json"),
    Case("export-deepspeed-json-strings", _doc(model__class='"}, "fp16": {"enabled": false}, "x": {"',
                                               target__name="\u2028"), target="deepspeed"),
    Case("export-model-class-not-a-string", _doc(model__class=["Net"]), ("model.class", "wrong type", "array"), 2),
    Case("export-reason-not-a-string", _doc(modules={"fc": {"format": "fp32", "reason": 7}}),
         ("modules.fc.reason", "wrong type"), 2),
    Case("export-integer-of-5000-digits", {**_doc(), "loss_scaling": {**_doc()["loss_scaling"], "growth_interval": 1}},
         ("integer literal too long", "5001 digits"), 2),
    Case("export-unknown-format-in-module", _doc(modules={"fc": {"format": "fp32\nimport os"}}),
         ("modules.fc.format", "unknown format", "'fp32\\nimport os'"), 2),
    # issue 32: a layout key with a lone surrogate hashed with str.encode() and every exporter exited 3
    # (UnicodeEncodeError); it is a policy like any other now, its name written as a literal
    *[Case(f"export-layout-lone-surrogate-{to}", _layout_doc(True), target=to)
      for to in ("deepspeed", "lightning", "accelerate", "fsdp", "torchao", "torchtitan")],
    Case("export-layout-lone-surrogate-edited", _layout_doc(False), ("model.layout", "does not hash"), 2),
    Case("export-fp8-recipe-a-list", {**_doc(), "fp8": {"modules": {"fc": {"recipe": ["fp8_rowwise"]}}}},
         ("fp8.modules", "not a known FP8 recipe", "['fp8_rowwise']"), 2, target="torchao"),
    Case("export-fp8-recipe-an-object", {**_doc(), "fp8": {"modules": {"fc": {"recipe": {"a": 1}}}}},
         ("fp8.modules", "not a known FP8 recipe"), 2, target="torchtitan"),
]


def _run_cli(case: Case, d: Path) -> tuple[int, str, str, Path, Path]:
    policy_path = d / case.path_name
    text = json.dumps(case.policy, indent=1)
    if case.id == "export-integer-of-5000-digits":
        text = text.replace('"growth_interval": 1', '"growth_interval": 1' + "0" * 5000)
    policy_path.write_text(text, encoding="utf-8")
    out = d / "exported.txt"
    err, so = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(so):
        try:
            code = main(["export", str(policy_path), "--to", case.target, "--out", str(out)])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, err.getvalue(), so.getvalue(), out, policy_path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_policy_exports_inert_code(tmp_path, case: Case):
    code, err, out_text, out, policy_path = _run_cli(case, tmp_path)
    assert "Traceback" not in err, err
    assert code == case.code, f"exit {code}; stderr:\n{err}"
    assert out_text == ""
    if case.code:
        for w in case.words:
            assert w in err, f"{w!r} missing from:\n{err}"
        assert err.splitlines()[0].startswith("precision-audit: error: ") and case.words[0] in err.splitlines()[0]
        assert not out.exists(), "a refused export writes nothing"
        assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
        return
    assert all(ch.isprintable() for line in err.splitlines() for ch in line), f"raw control text on stderr: {err!r}"
    from precision_audit.policy.io import load_policy

    policy = load_policy(policy_path)
    text = out.read_text(encoding="utf-8")
    assert text == export_policy(policy, case.target, policy_path=str(policy_path)).text
    check_exports(policy, str(policy_path), tmp_path)


def test_export_to_stdout_is_utf8_bytes_whatever_the_locale(tmp_path):
    """Non-ASCII names reach stdout as UTF-8 even under LC_ALL=C with an ASCII stdout encoding."""
    path = tmp_path / "policy.json"
    save_policy(make_policy(model_class="Réseau—ü", modules={"kopf.ß": ("fp32", "ünderflow")}), path)
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run([sys.executable, "-m", "precision_audit", "export", str(path), "--to", "lightning"],
                          capture_output=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    text = proc.stdout.decode("utf-8")
    assert "'Réseau—ü'" in text and "'kopf.ß'" in text
    compile(text, "<stdout>", "exec")


# ---------------------------------------------------------------------------------------------------------------
# arbitrary Unicode in every string field
# ---------------------------------------------------------------------------------------------------------------

SPECIAL = ["\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029", "\x00", "\ud800", "\udfff",
           "'", '"', '"""', "'''", "\\", "#", "\u202e", "\ufeff", "\t", "coding: latin-1", ".", INJECT]
chunk = st.one_of(st.text(max_size=6), st.sampled_from(SPECIAL),
                  st.characters(categories=["Cc", "Cf", "Cs", "Zl", "Zp", "Co"]).map(str))
# Each string as it comes out of a JSON file (policy.json): a JSON reader joins a high and a low surrogate that
# meet into one astral character, so two lone surrogates side by side are not a string a policy can hold.
hostile = st.lists(chunk, max_size=5).map("".join).map(lambda s: json.loads(json.dumps(s)))
module_name = st.lists(hostile, min_size=1, max_size=3).map(".".join).filter(bool)
formats = st.sampled_from(["fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])


@st.composite
def hostile_policies(draw) -> tuple[Policy, str]:
    modules = draw(st.dictionaries(module_name, st.tuples(formats, hostile), max_size=4))
    policy = make_policy(model_class=draw(hostile), target=draw(hostile), default=draw(formats), modules=modules)
    return policy, draw(hostile)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_policies())
def test_any_unicode_in_any_string_field_exports_inert_code(case):
    policy, policy_path = case
    # The policy as a user gets it: written to policy.json and read back (JSON escapes the surrogates).
    from precision_audit.policy.io import dumps_policy, parse_policy

    policy = parse_policy(dumps_policy(policy))
    assert policy.model_class == case[0].model_class
    with tempfile.TemporaryDirectory(prefix="pa-export-") as folder:
        check_exports(policy, policy_path, Path(folder))


def test_the_checks_catch_an_injection(tmp_path, monkeypatch):
    """The checks fail on an exporter that writes a name raw into a comment (as before this fix), and the
    subprocess run sees the file and the print the injected line makes."""
    from precision_audit.policy import exporters

    monkeypatch.setattr(exporters, "_comment", lambda text: text.replace("\\n", "\n"))
    policy = make_policy(model_class="Net\nopen('pwned', 'w').close(); print('pwned')\n#")
    with pytest.raises(AssertionError, match="changed the code"):
        check_exports(policy, "policy.json", tmp_path)
    path = tmp_path / "injected.py"
    path.write_text(export_policy(policy, "fsdp").text, encoding="utf-8")
    proc, left = run_exported([path])
    assert left == ["pwned"] and proc.stdout.startswith("pwned\n")


def test_catalogue_ids_are_unique():
    """These cases count toward the bad-input catalogue (tests/cli/test_bad_inputs.py); ids must not repeat."""
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 10


def test_load_policy_of_a_layout_with_a_lone_surrogate_is_a_policy_error(tmp_path):
    """load_policy raised UnicodeEncodeError (hashing the layout) instead of a PolicyError naming the field."""
    from precision_audit.errors import PolicyError
    from precision_audit.policy.io import load_policy

    path = tmp_path / "policy.json"
    path.write_text(json.dumps(_layout_doc(False)), encoding="utf-8")
    with pytest.raises(PolicyError, match="model.layout"):
        load_policy(path)
    path.write_text(json.dumps(_layout_doc(True)), encoding="utf-8")
    assert "enc\ud800" in load_policy(path).model_layout
