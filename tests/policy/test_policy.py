"""policy.json: loading, validation (every malformed input is a PolicyError naming the field), versions, the
fingerprint and the module layout, refusing another model with the differing names, atomic saving, and the
JSON Schema kept in sync with what the code writes."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precision_audit.errors import OutputError, PolicyError
from precision_audit.policy import (
    POLICY_FORMATS,
    LossScaling,
    ModuleOverride,
    Policy,
    fingerprint,
    load_policy,
    model_layout,
    named_modules,
    parse_policy,
    save_policy,
)

# torch.compile's first import warns about torch.jit internals; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())  # the repository
sys.path.insert(0, str(ROOT / "sample_models" / "fp16_trouble"))
import model as fp16_trouble  # noqa: E402

# policy.json exactly as precision-audit 0.1.0 wrote it for sample_models/fp16_trouble --target v100: a version-1
# policy from before model.layout existed. It must keep loading (docs/policy.md, "Versions": N's policy loads in N+1).
V1_POLICY = """{
  "schema": "precision-audit/policy",
  "version": 1,
  "tool": {"name": "precision-audit", "version": "0.1.0"},
  "model": {
    "class": "FP16Trouble",
    "fingerprint": "sha256:34cabeca7e2e371256d96284ffa60d5b0fbe3a33c9c03b5e97d06ef58cf9bc97",
    "modules": 9
  },
  "target": {"name": "V100 SXM2", "compute_capability": [7, 0], "key": "v100-sxm2"},
  "default_format": "fp16",
  "modules": {
    "hot": {"format": "fp32", "reason": "fp16 output reaches 1.97e+05 > 6.55e+04 (27.6% of its values overflow)"}
  },
  "loss_scaling": {"enabled": true, "init_scale": 131072.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                   "growth_interval": 2000},
  "tf32": {"matmul": false, "cudnn": false}
}
"""


def _old_fingerprint(model: nn.Module) -> str:
    """The fingerprint algorithm of version 0.1.0, verbatim: policies it wrote must keep matching."""
    h = hashlib.sha256()
    for name, m in model.named_modules():
        params = ",".join(f"{pn}:{'x'.join(map(str, p.shape))}" for pn, p in m.named_parameters(recurse=False))
        h.update(f"{name}\t{type(m).__name__}\t{params}\n".encode())
    return "sha256:" + h.hexdigest()


def _doc() -> dict:
    return json.loads(V1_POLICY)


def _doc_with_layout() -> dict:
    d = _doc()
    d["model"]["layout"] = model_layout(fp16_trouble.build_model())
    return d


# -- versions and round trips ------------------------------------------------------------------------------

def test_v1_policy_loads_and_round_trips():
    p = parse_policy(V1_POLICY)
    assert p.default_format == "fp16" and p.format_for("hot") == "fp32" and p.format_for("head") == "fp16"
    assert p.loss_scaling == LossScaling(enabled=True, init_scale=131072.0)
    assert p.target_compute_capability == (7, 0) and p.target_key == "v100-sxm2"
    assert p.model_layout is None
    assert p.to_dict() == _doc(), "a v1 policy must be written back unchanged"


def test_fingerprint_is_unchanged_from_version_0_1(root):
    for sample in ("fp16_trouble", "mlp", "cnn", "tiny_gpt"):
        sys.path.insert(0, str(root / "sample_models" / sample))
        try:
            import importlib.util

            spec = importlib.util.spec_from_file_location(f"_sample_{sample}",
                                                          root / "sample_models" / sample / "model.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        finally:
            sys.path.pop(0)
        m = mod.build_model()
        fp, n = fingerprint(m)
        assert fp == _old_fingerprint(m), sample
        assert n == len(list(m.named_modules()))
    assert fingerprint(fp16_trouble.build_model())[0] == _doc()["model"]["fingerprint"]


def test_layout_names_every_module_and_hashes_to_the_fingerprint():
    m = fp16_trouble.build_model()
    layout = model_layout(m)
    assert list(layout) == [n for n, _ in m.named_modules()]
    assert layout["hot"] == "Linear[weight:64x32,bias:64]"
    assert layout[""] == "FP16Trouble[]" and layout["faint.1"] == "Tanh[]"
    p = Policy.from_dict(_doc_with_layout())
    assert p.model_layout == layout
    assert Policy.from_dict(p.to_dict()) == p


def test_unknown_top_level_fields_are_kept():
    d = _doc()
    d["planner"] = {"passes": 3}
    p = Policy.from_dict(d)
    assert p.extra == {"planner": {"passes": 3}}
    assert p.to_dict()["planner"] == {"passes": 3}


@pytest.mark.parametrize("version", [99, 2, 0, -1], ids=lambda v: f"v{v}")
def test_unknown_version_is_refused_naming_the_field(version):
    d = _doc()
    d["version"] = version
    with pytest.raises(PolicyError) as e:
        Policy.from_dict(d)
    assert "'version'" in e.value.message and str(version) in e.value.message
    assert "1" in (e.value.expected or "")
    if version > 1:
        assert "upgrade" in e.value.message


# -- malformed input: a PolicyError naming the field ---------------------------------------------------------

def test_bad_json_names_line_and_column(tmp_path):
    bad = V1_POLICY.replace('"default_format": "fp16",', '"default_format": "fp16"')  # a missing comma
    f = tmp_path / "policy.json"
    f.write_text(bad)
    line = bad.splitlines().index('  "modules": {') + 1
    with pytest.raises(PolicyError) as e:
        load_policy(f)
    assert f"line {line}, column 3" in e.value.message, e.value.message
    assert str(f) in e.value.message


def _delete(path):
    def breaker(d):
        target = d
        for k in path[:-1]:
            target = target[k]
        del target[path[-1]]
    return breaker


def _set(path, value):
    def breaker(d):
        target = d
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = value
    return breaker


MISSING = [("schema",), ("version",), ("model",), ("model", "class"), ("model", "fingerprint"), ("model", "modules"),
           ("target",), ("target", "name"), ("default_format",), ("modules",), ("modules", "hot", "format"),
           ("loss_scaling",), ("loss_scaling", "enabled"), ("loss_scaling", "init_scale"), ("tf32", "matmul"),
           ("tf32", "cudnn")]


@pytest.mark.parametrize("path", MISSING, ids=".".join)
def test_missing_field_is_named(path):
    d = _doc()
    _delete(path)(d)
    with pytest.raises(PolicyError) as e:
        Policy.from_dict(d)
    assert f"'{'.'.join(path)}' is missing" in e.value.message, e.value.message


WRONG = [
    (("default_format",), "half", "'default_format' has an unknown format"),
    (("modules", "hot", "format"), "fp64", "'modules.hot.format' has an unknown format"),
    (("modules", "hot", "format"), 16, "'modules.hot.format' has the wrong type"),
    (("modules", "hot"), "fp32", "'modules.hot' must be an object"),
    (("modules", "hot", "reason"), 3, "'modules.hot.reason' has the wrong type"),
    (("modules",), ["hot"], "'modules' has the wrong type"),
    (("version",), "1", "'version' has the wrong type"),
    (("version",), True, "'version' has the wrong type"),
    (("version",), 1.0, "'version' has the wrong type"),
    (("schema",), "precision-audit/audit", "'schema'"),
    (("model", "modules"), "9", "'model.modules' has the wrong type"),
    (("model", "modules"), 0, "'model.modules' must be >= 1"),
    (("model", "fingerprint"), "sha256:abc", "'model.fingerprint' is not a fingerprint"),
    (("model", "fingerprint"), "SHA256:" + "0" * 64, "'model.fingerprint' is not a fingerprint"),
    (("model", "layout"), ["hot"], "'model.layout' has the wrong type"),
    (("model", "layout"), {"hot": 3}, "'model.layout' must map module names"),
    (("model", "layout"), {"hot": "Linear[weight:64x32,bias:64]"}, "'model.layout' lists 1 modules"),
    (("target", "compute_capability"), [9], "'target.compute_capability' must be [major, minor]"),
    (("target", "compute_capability"), [9, True], "'target.compute_capability'"),
    (("target", "key"), 5, "'target.key' has the wrong type"),
    (("tool",), "0.1", "'tool' has the wrong type"),
    (("loss_scaling", "enabled"), "yes", "'loss_scaling.enabled' has the wrong type"),
    (("loss_scaling", "init_scale"), "65536", "'loss_scaling.init_scale' has the wrong type"),
    (("loss_scaling", "init_scale"), 0, "'loss_scaling.init_scale' must be a positive"),
    (("loss_scaling", "init_scale"), float("inf"), "'loss_scaling.init_scale' must be a finite number"),
    (("loss_scaling", "init_scale"), 10 ** 400, "'loss_scaling.init_scale' is out of range"),
    (("loss_scaling", "growth_factor"), "2", "'loss_scaling.growth_factor' has the wrong type"),
    (("loss_scaling", "growth_factor"), 1.0, "'loss_scaling.growth_factor' must be > 1"),
    (("loss_scaling", "backoff_factor"), 1.5, "'loss_scaling.backoff_factor' must be in (0, 1)"),
    (("loss_scaling", "growth_interval"), 2.5, "'loss_scaling.growth_interval' has the wrong type"),
    (("loss_scaling", "growth_interval"), 0, "'loss_scaling.growth_interval' must be >= 1"),
    (("tf32",), [True, True], "'tf32' has the wrong type"),
    (("tf32", "matmul"), 1, "'tf32.matmul' has the wrong type"),
]


@pytest.mark.parametrize("path,value,message", WRONG, ids=lambda x: ".".join(x) if isinstance(x, tuple) else None)
def test_wrong_value_is_named(path, value, message):
    d = _doc()
    _set(path, value)(d)
    with pytest.raises(PolicyError) as e:
        Policy.from_dict(d)
    assert message in e.value.message, e.value.message


def test_unknown_format_lists_the_choices():
    d = _doc()
    d["default_format"] = "int8"
    with pytest.raises(PolicyError) as e:
        Policy.from_dict(d)
    assert e.value.choices == POLICY_FORMATS
    assert "valid choices: fp32, tf32, bf16, fp16, fp8_e4m3, fp8_e5m2" in e.value.message


def test_layout_that_does_not_match_the_fingerprint_is_refused():
    d = _doc_with_layout()
    d["model"]["layout"]["hot"] = "Linear[weight:64x16,bias:64]"
    with pytest.raises(PolicyError, match="does not hash to 'model.fingerprint'"):
        Policy.from_dict(d)


@pytest.mark.parametrize("text,what", [
    ('{"a": 1, "a": 2}', "the key 'a' twice"),
    (V1_POLICY.replace("131072.0", "NaN"), "NaN, which is not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ("", "line 1, column 1"),
    ("[" * 100_000, "nested too deeply"),
], ids=["duplicate-key", "nan", "array", "empty", "deep"])
def test_odd_json_is_a_policy_error(text, what):
    with pytest.raises(PolicyError) as e:
        parse_policy(text)
    assert what in e.value.message, e.value.message


def test_unreadable_files_are_policy_errors(tmp_path):
    with pytest.raises(PolicyError, match="no policy file"):
        load_policy(tmp_path / "nope.json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(tmp_path / "bin.json")
    (tmp_path / "policy.json").write_text(V1_POLICY)
    assert load_policy(tmp_path).default_format == "fp16"  # a folder holding policy.json


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: (st.lists(inner, max_size=3)
                                    | st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                     max_leaves=8)


def _paths(d, prefix=()):
    yield prefix
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, prefix + (k,))


ALL_PATHS = [p for p in _paths(_doc_with_layout()) if p]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(ALL_PATHS), value=_JSON, delete=st.booleans())
def test_any_damage_is_a_policy_error_or_a_valid_policy(path, value, delete):
    """Replace or delete any field with any JSON value: from_dict raises PolicyError or returns a Policy."""
    d = _doc_with_layout()
    (_delete(path) if delete else _set(path, value))(d)
    try:
        p = Policy.from_dict(d)
    except PolicyError as e:
        assert e.message
        return
    assert isinstance(p, Policy)
    Policy.from_dict(p.to_dict())


@settings(max_examples=150, deadline=None)
@given(value=_JSON)
def test_any_document_is_a_policy_error(value):
    with pytest.raises(PolicyError):
        Policy.from_dict(value)


def test_direct_construction_is_validated():
    with pytest.raises(PolicyError, match="'default_format' has an unknown format"):
        Policy("M", "sha256:x", 1, "H100", None, "fp12")
    with pytest.raises(PolicyError, match="'modules.a' must be a ModuleOverride"):
        Policy("M", "sha256:x", 1, "H100", None, "bf16", modules={"a": "fp32"})
    with pytest.raises(PolicyError, match="'loss_scaling.growth_interval' has the wrong type"):
        LossScaling(growth_interval=2.0)
    with pytest.raises(PolicyError, match="unknown format"):
        ModuleOverride("fp64")


# -- the model check -----------------------------------------------------------------------------------------

class Wider(fp16_trouble.FP16Trouble):
    """fp16_trouble with `head` resized, `faint.1` swapped for another type and an extra module."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(64, 16)
        self.faint[1] = nn.ReLU()
        self.extra = nn.Linear(8, 8)
        del self.act


def test_same_model_passes_the_check():
    p = Policy.from_dict(_doc_with_layout())
    p.check_model(fp16_trouble.build_model())
    p.check_model(torch.compile(fp16_trouble.build_model()))  # wrappers are looked through


def test_another_model_is_refused_with_the_differing_names():
    p = Policy.from_dict(_doc_with_layout())
    with pytest.raises(PolicyError) as e:
        p.check_model(Wider())
    msg = e.value.message
    assert "another model" in msg
    assert "missing from the model (1): 'act'" in msg, msg
    assert "not in the policy (1): 'extra'" in msg, msg
    assert "head: Linear[weight:8x64,bias:8] -> Linear[weight:16x64,bias:16]" in msg, msg
    assert "faint.1: Tanh[] -> ReLU[]" in msg, msg
    assert "norm" not in msg.split("found:")[0].replace("FP16Trouble", "")


def test_another_model_without_layout_says_the_fingerprints_differ():
    p = parse_policy(V1_POLICY)
    with pytest.raises(PolicyError) as e:
        p.check_model(Wider())
    assert "fingerprints differ" in e.value.message and "no model.layout" in e.value.message
    assert "FP16Trouble with 9 modules" in e.value.message


def test_long_difference_lists_are_clipped():
    a = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])
    b = nn.Sequential(*[nn.Linear(4, 5) for _ in range(30)])
    fp, n = fingerprint(a)
    p = Policy("Sequential", fp, n, "H100", None, "bf16", model_layout=model_layout(a))
    with pytest.raises(PolicyError) as e:
        p.check_model(b)
    assert "changed type or parameter shapes (30)" in e.value.message and "and 18 more" in e.value.message


def test_override_of_a_module_the_model_lacks_is_refused():
    d = _doc()
    d["modules"]["hott"] = {"format": "fp32", "reason": ""}
    p = Policy.from_dict(d)
    with pytest.raises(PolicyError) as e:
        p.check_model(fp16_trouble.build_model())
    assert "'hott' (did you mean 'hot'?)" in e.value.message


def test_effective_format_inherits_from_the_nearest_override():
    d = _doc()
    d["modules"] = {"faint": {"format": "fp32", "reason": ""}, "faint.2": {"format": "bf16", "reason": ""}}
    p = Policy.from_dict(d)
    assert p.effective_format("faint.0") == "fp32"
    assert p.effective_format("faint.2") == "bf16"
    assert p.effective_format("faint") == "fp32"
    assert p.effective_format("head") == p.effective_format("") == "fp16"
    q = p.with_override("head", "fp32", "why")
    assert q.format_for("head") == "fp32" and p.format_for("head") == "fp16"


def test_named_modules_looks_through_wrappers():
    m = fp16_trouble.build_model()
    m.faint = torch.compile(m.faint)
    names = [n for n, _ in named_modules(torch.compile(m))]
    assert names == [n for n, _ in fp16_trouble.build_model().named_modules()]
    assert fingerprint(m)[0] == _doc()["model"]["fingerprint"]


# -- saving ----------------------------------------------------------------------------------------------------

def test_save_policy_round_trips_and_is_atomic(tmp_path, monkeypatch):
    p = Policy.from_dict(_doc_with_layout())
    f = tmp_path / "sub" / "policy.json"
    save_policy(p, f)
    assert load_policy(f) == p
    assert [x.name for x in f.parent.iterdir()] == ["policy.json"]
    good = f.read_text()

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OutputError, match="No space left"):
        save_policy(p.with_override("head", "fp32", ""), f)
    assert f.read_text() == good, "a failed save must leave the old file in place"
    assert [x.name for x in f.parent.iterdir()] == ["policy.json"], "no temporary file left behind"


def test_save_policy_into_a_folder_path_is_an_output_error(tmp_path):
    with pytest.raises(OutputError):
        save_policy(parse_policy(V1_POLICY), tmp_path)


# -- the JSON Schema and the light import ----------------------------------------------------------------------

def test_json_schema_matches_what_the_code_writes():
    from jsonschema import Draft202012Validator

    from precision_audit.record.schemas import load_schema

    schema = load_schema("policy")
    Draft202012Validator.check_schema(schema)
    v = Draft202012Validator(schema)
    for doc in (_doc(), _doc_with_layout(), Policy.from_dict(_doc_with_layout()).to_dict()):
        errors = list(v.iter_errors(doc))
        assert not errors, errors[0].message
    assert "layout" in schema["properties"]["model"]["properties"]
    assert set(schema["$defs"]["format"]["enum"]) == set(POLICY_FORMATS)
    bad = copy.deepcopy(_doc_with_layout())
    bad["model"]["layout"]["hot"] = 3
    assert list(v.iter_errors(bad))


def test_import_stays_light():
    """`import precision_audit` + load_policy + the runtime pull in none of the audit machinery."""
    code = ("import sys, precision_audit\n"
            "from precision_audit import load_policy\n"
            "import precision_audit.runtime, precision_audit.policy.exporters\n"
            "heavy = [m for m in sys.modules if m.startswith(('precision_audit.capture', 'precision_audit.analysis',"
            " 'precision_audit.report', 'precision_audit.planning', 'precision_audit.audit', 'jinja2',"
            " 'tensorboard'))]\n"
            "print(heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
