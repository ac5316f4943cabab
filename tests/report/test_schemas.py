"""The JSON Schemas of audit.json and policy.json (README.md, "Outputs"; docs/policy.md): they are valid schemas,
every sample's real output validates against them, and malformed documents are rejected."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from jsonschema import Draft202012Validator

from conftest import SAMPLES
from precision_audit.record.schemas import load_schema, validate_audit, validate_policy

FORMATS = {"fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"}


def _policy_json(sample_audits, name: str, **options) -> dict:
    _, out, _ = sample_audits.get(name, **options)
    return json.loads((out / "policy.json").read_text())


@pytest.mark.parametrize("name", ["audit", "policy"])
def test_schemas_are_valid_draft_2020_12(name):
    schema = load_schema(name)
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["schema"]["const"] == f"precision-audit/{name}"


def test_load_schema_returns_a_fresh_copy():
    a = load_schema("audit")
    a["required"].clear()
    assert "layers" in load_schema("audit")["required"]


@pytest.mark.parametrize("name", SAMPLES)
def test_sample_outputs_validate(sample_audits, name):
    validate_audit(sample_audits.audit_json(name))
    validate_policy(_policy_json(sample_audits, name))


def test_v100_fp16_trouble_validates(sample_audits):
    """No BF16 on V100: bf16 is skipped, fp16 is unsafe as is, exit code 1 — still a valid document."""
    result, _, _ = sample_audits.get("fp16_trouble", target="v100")
    audit = sample_audits.audit_json("fp16_trouble", target="v100")
    validate_audit(audit)
    validate_policy(_policy_json(sample_audits, "fp16_trouble", target="v100"))
    assert result.exit_code == 1 == audit["verdict"]["exit_code"]
    assert audit["formats"] == ["fp16"]
    assert [s["format"] for s in audit["formats_skipped"]] == ["bf16"]
    assert set(audit["summary"]) == {"fp32", "fp16"}


@pytest.mark.parametrize("name", SAMPLES)
def test_cross_field_consistency(sample_audits, name):
    """What a schema cannot say: the per-format maps agree with `formats`, and policy.json matches audit.json."""
    audit = sample_audits.audit_json(name)
    policy = _policy_json(sample_audits, name)
    formats = set(audit["formats"])
    assert set(audit["summary"]) == {"fp32"} | formats
    for L in audit["layers"]:
        assert set(L["error"]) == formats, L["name"]
    names = [L["name"] for L in audit["layers"]]
    assert len(names) == len(set(names))
    assert len(names) <= audit["model"]["modules"]
    assert set(audit["verdict"]["safe_formats"]) <= formats
    assert {k: policy["model"][k] for k in ("class", "fingerprint", "modules")} == \
        {k: audit["model"][k] for k in ("class", "fingerprint", "modules")}
    assert policy["default_format"] == audit["plan"]["default_format"]
    assert set(policy["modules"]) == set(audit["plan"]["overrides"])


# -- negative cases: each breaker damages a valid document and returns the path the error must point at ------

def _calls_zero(d):
    d["layers"][0]["calls"] = 0
    return ["layers", 0, "calls"]


def _fraction_above_one(d):
    d["layers"][0]["activation"]["fractions"]["fp16"]["overflow"] = 1.5
    return ["layers", 0, "activation", "fractions", "fp16", "overflow"]


def _gradient_fraction_negative(d):
    d["layers"][0]["gradient"]["output"]["fp16"]["unscaled"]["flushed"] = -0.1
    return ["layers", 0, "gradient", "output", "fp16", "unscaled", "flushed"]


def _unknown_mode(d):
    d["mode"] = "gpu"
    return ["mode"]


def _missing_layers(d):
    del d["layers"]
    return []


def _bad_fingerprint(d):
    d["model"]["fingerprint"] = "sha256:" + "A" * 64
    return ["model", "fingerprint"]


def _short_fingerprint(d):
    d["model"]["fingerprint"] = "sha256:abc"
    return ["model", "fingerprint"]


def _unknown_format(d):
    d["formats"] = ["fp16", "int8"]
    return ["formats", 1]


def _unknown_summary_format(d):
    d["summary"]["half"] = d["summary"]["fp16"]
    return ["summary"]


def _missing_fp32_summary(d):
    del d["summary"]["fp32"]
    return ["summary"]


def _summary_missing_step_time(d):
    del d["summary"]["bf16"]["step_time"]["estimated_note"]
    return ["summary", "bf16", "step_time"]


def _accumulated_missing_metric(d):
    del d["layers"][0]["error"]["fp16"]["accumulated"]["cosine"]
    return ["layers", 0, "error", "fp16", "accumulated"]


def _metric_is_a_string(d):
    d["layers"][0]["error"]["fp16"]["accumulated"]["rel_l2"] = "NaN"
    return ["layers", 0, "error", "fp16", "accumulated", "rel_l2"]


def _version_two(d):
    d["version"] = 2
    return ["version"]


def _wrong_schema_id(d):
    d["schema"] = "precision-audit/policy"
    return ["schema"]


def _bad_loss_kind(d):
    d["loss"]["kind"] = "hinge"
    return ["loss", "kind"]


def _exit_code_two(d):
    d["verdict"]["exit_code"] = 2
    return ["verdict", "exit_code"]


def _exit_one_with_safe_formats(d):
    d["verdict"]["exit_code"] = 1
    return ["verdict", "safe_formats"]


def _layer_plan_unknown_format(d):
    d["layers"][0]["plan"]["format"] = "int8"
    return ["layers", 0, "plan", "format"]


def _layer_missing_cost_note(d):
    del d["layers"][0]["cost_note"]
    return ["layers", 0]


AUDIT_BREAKERS = [_calls_zero, _fraction_above_one, _gradient_fraction_negative, _unknown_mode, _missing_layers,
                  _bad_fingerprint, _short_fingerprint, _unknown_format, _unknown_summary_format,
                  _missing_fp32_summary, _summary_missing_step_time, _accumulated_missing_metric,
                  _metric_is_a_string, _version_two, _wrong_schema_id, _bad_loss_kind, _exit_code_two,
                  _exit_one_with_safe_formats, _layer_plan_unknown_format, _layer_missing_cost_note]


@pytest.mark.parametrize("breaker", AUDIT_BREAKERS, ids=lambda f: f.__name__.lstrip("_"))
def test_malformed_audit_is_rejected(sample_audits, breaker):
    doc = copy.deepcopy(sample_audits.audit_json("tiny_gpt"))
    validate_audit(doc)  # the unmodified copy is fine
    assert doc["verdict"]["safe_formats"], "tiny_gpt is expected to be safe in some format"
    path = breaker(doc)
    with pytest.raises(jsonschema.ValidationError) as excinfo:
        validate_audit(doc)
    assert list(excinfo.value.absolute_path) == path, excinfo.value.message


def test_audit_accepts_added_fields(sample_audits):
    """The contract grows by adding fields: unknown properties anywhere are fine."""
    doc = copy.deepcopy(sample_audits.audit_json("tiny_gpt"))
    doc["new_top_level"] = {"x": 1}
    doc["layers"][0]["new_field"] = [1, 2]
    doc["summary"]["fp16"]["new_metric"] = None
    validate_audit(doc)


def _unknown_default_format(d):
    d["default_format"] = "fp12"
    return ["default_format"]


def _policy_version_two(d):
    d["version"] = 2
    return ["version"]


def _module_unknown_format(d):
    d["modules"]["lm_head"] = {"format": "half", "reason": "x"}
    return ["modules", "lm_head", "format"]


def _zero_init_scale(d):
    d["loss_scaling"]["init_scale"] = 0
    return ["loss_scaling", "init_scale"]


def _growth_factor_one(d):
    d["loss_scaling"]["growth_factor"] = 1.0
    return ["loss_scaling", "growth_factor"]


def _backoff_one(d):
    d["loss_scaling"]["backoff_factor"] = 1.0
    return ["loss_scaling", "backoff_factor"]


def _growth_interval_zero(d):
    d["loss_scaling"]["growth_interval"] = 0
    return ["loss_scaling", "growth_interval"]


def _bad_compute_capability(d):
    d["target"]["compute_capability"] = [9]
    return ["target", "compute_capability"]


def _policy_bad_fingerprint(d):
    d["model"]["fingerprint"] = "md5:1234"
    return ["model", "fingerprint"]


def _tf32_not_bool(d):
    d["tf32"]["matmul"] = "yes"
    return ["tf32", "matmul"]


POLICY_BREAKERS = [_unknown_default_format, _policy_version_two, _module_unknown_format, _zero_init_scale,
                   _growth_factor_one, _backoff_one, _growth_interval_zero, _bad_compute_capability,
                   _policy_bad_fingerprint, _tf32_not_bool]


@pytest.mark.parametrize("breaker", POLICY_BREAKERS, ids=lambda f: f.__name__.lstrip("_"))
def test_malformed_policy_is_rejected(sample_audits, breaker):
    doc = copy.deepcopy(_policy_json(sample_audits, "tiny_gpt"))
    validate_policy(doc)
    path = breaker(doc)
    with pytest.raises(jsonschema.ValidationError) as excinfo:
        validate_policy(doc)
    assert list(excinfo.value.absolute_path) == path, excinfo.value.message


def test_policy_design_example_validates():
    """The design's example policy (with a real-looking fingerprint), and a target without a compute capability."""
    doc = {
        "schema": "precision-audit/policy", "version": 1,
        "tool": {"name": "precision-audit", "version": "0.1.0"},
        "model": {"class": "TinyGPT", "fingerprint": "sha256:" + "0123456789abcdef" * 4, "modules": 57},
        "target": {"name": "H100 SXM", "compute_capability": [9, 0]},
        "default_format": "bf16",
        "modules": {"lm_head": {"format": "fp32", "reason": "fp16/bf16 error 3.1e-2 > budget 1e-2"}},
        "loss_scaling": {"enabled": False, "init_scale": 65536.0, "growth_factor": 2.0,
                         "backoff_factor": 0.5, "growth_interval": 2000},
        "tf32": {"matmul": True, "cudnn": True},
    }
    validate_policy(doc)
    doc["target"] = {"name": "custom", "compute_capability": None}
    validate_policy(doc)
    assert set(load_schema("policy")["$defs"]["format"]["enum"]) == FORMATS
