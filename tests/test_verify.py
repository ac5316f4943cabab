"""`precision-audit verify`: A/B short training under FP32, the policy, plain BF16 and plain FP16."""

from __future__ import annotations

import json

from conftest import ROOT
from precision_audit.cli import main

TROUBLE = ROOT / "sample_models" / "fp16_trouble"


def test_verify_adds_loss_curves_to_the_audit_and_the_report(tmp_path, capsys):
    out = tmp_path / "o"
    args = [str(TROUBLE / "model.py"), "--batch", str(TROUBLE / "sample.pt"), "--out", str(out), "-q"]
    assert main(args + ["--target", "v100", "--steps", "0"]) == 1  # fp16 alone is unsafe on a V100
    assert main(["verify"] + args[:3] + ["--policy", str(out / "policy.json"), "--out", str(out), "--steps", "6",
                                         "-q"]) == 0
    a = json.loads((out / "audit.json").read_text())
    v = a["verify"]
    assert set(v["curves"]) == {"fp32", "policy", "bf16", "fp16"}
    assert all(len(c) == 6 for c in v["curves"].values())
    # the policy keeps 'hot' in fp32, so it trains like fp32; plain fp16 overflows in 'hot' every step
    assert all(x is not None for x in v["curves"]["policy"])
    assert v["final_loss_rel_change"]["policy"] < 1e-2
    assert v["skipped_steps"]["fp16"] == 6 and all(x is None for x in v["curves"]["fp16"])
    html = (out / "report.html").read_text()
    assert 'id="verify"' in html and "policy" in html
    printed = capsys.readouterr().out
    assert "policy" in printed and "fp16" in printed


def test_verify_refuses_a_policy_for_another_model(tmp_path, capsys):
    out = tmp_path / "o"
    mlp = ROOT / "sample_models" / "mlp"
    assert main([str(mlp / "model.py"), "--batch", str(mlp / "sample.pt"), "--out", str(out), "-q",
                 "--steps", "0"]) == 0
    code = main(["verify", str(TROUBLE / "model.py"), "--batch", str(TROUBLE / "sample.pt"),
                 "--policy", str(out / "policy.json"), "--out", str(tmp_path / "v"), "--steps", "2", "-q"])
    assert code == 2
    assert "another model" in capsys.readouterr().err
