"""`--tokens-per-step N` (docs/fp8.md, "The plan"): the FP8 plan prices every linear at N rows per training step
instead of the audited batch's; bad values and the option without an FP8 format are refused (exit 2)."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from precision_audit.audit import AuditOptions
from precision_audit.cli import main
from precision_audit.errors import OptionError
from precision_audit.fp8.cost import layer_cost
from precision_audit.gpus import resolve_target

MODEL = str(ROOT / "sample_models" / "fp8_outliers" / "model.py")


def test_the_plan_is_priced_at_the_given_rows_per_step(tmp_path):
    out = tmp_path / "o"
    assert main([MODEL, "--formats", "fp8_e4m3", "--target", "h100", "--steps", "0", "--tokens-per-step", "65536",
                 "--out", str(out), "-q"]) == 0
    plan = json.loads((out / "audit.json").read_text())["fp8"]["plan"]
    assert set(plan["tokens_per_step"].values()) == {65536}
    h100 = resolve_target("h100")
    layers = {L["name"]: L for L in json.loads((out / "audit.json").read_text())["fp8"]["layers"]}
    for name, m in plan["modules"].items():
        L = layers[name]
        assert m["gemm_flops"] == 3 * 2 * 65536 * L["in_features"] * L["out_features"] * L["calls"]
        for recipe, c in m["cost"].items():  # the cost model at 65536 rows, computed here independently
            ref = layer_cost(65536, L["in_features"], L["out_features"], recipe, h100)
            assert c["speedup_vs_bf16"] == pytest.approx(ref.speedup)
    # at the audited batch's 128 rows nothing pays (tests/fp8/test_fp8_audit.py); at 65536 the 256-wide head does
    assert plan["modules"]["head"]["recipe"] == "fp8_tensorwise"
    assert "at 65536 tokens" in plan["modules"]["head"]["reason"]
    assert json.loads((out / "policy.json").read_text())["fp8"]["modules"]["head"]["recipe"] == "fp8_tensorwise"


@pytest.mark.parametrize("argv, says", [
    (["--formats", "fp8_e4m3", "--tokens-per-step", "0"], "whole number from 1 to"),
    (["--formats", "bf16", "--tokens-per-step", "4096"], "no FP8 format"),
])
def test_bad_tokens_per_step_is_refused(tmp_path, capsys, argv, says):
    out = tmp_path / "o"
    assert main([MODEL, "--steps", "0", "--out", str(out), "-q"] + argv) == 2
    assert says in capsys.readouterr().err
    assert not out.exists()


def test_api_option_is_checked():
    with pytest.raises(OptionError, match="whole number"):
        AuditOptions(model=MODEL, formats="fp8_e4m3", fp8_tokens_per_step=True)
    assert AuditOptions(model=MODEL, formats="bf16,fp8_e4m3", fp8_tokens_per_step=8).fp8_tokens_per_step == 8
