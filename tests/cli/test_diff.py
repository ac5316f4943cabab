"""``precision-audit diff A B`` (issue 36): two audits of one model, before and after a planted change, name exactly
the changed layer; the noise rule on hand-made entries; bad input is a user error (exit 2, one message)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import precision_audit as pa
from precision_audit.cli import main
from precision_audit.report.diff import diff_audits, layer_changes


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.norm(self.a(x)))))


@pytest.fixture(scope="module")
def audits(tmp_path_factory):
    """Audits of one model before and after ``a``'s weights and bias are multiplied by 2^10: its output grows
    exactly 2^10-fold (10 bits less headroom in every format, an overflow in fp8_e4m3), and the LayerNorm after it
    gives the rest of the model the same inputs (up to its eps), so no other layer should be named."""
    root = tmp_path_factory.mktemp("diff")
    torch.manual_seed(0)
    model = Chain()
    x, y = torch.randn(16, 16), torch.randn(16, 4)
    pa.audit(model, (x, y), out=root / "before", steps=0, progress=False)
    with torch.no_grad():
        model.a.weight.mul_(1024.0)
        model.a.bias.mul_(1024.0)
    pa.audit(model, (x, y), out=root / "after", steps=0, progress=False)
    return root / "before", root / "after"


def test_diff_names_exactly_the_changed_layer(audits, capsys):
    before, after = audits
    assert main(["diff", str(before / "audit.json"), str(after), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [c["layer"] for c in d["changed"]] == ["a"] and d["same_model"] and not d["added"] and not d["removed"]
    head = {ch["format"]: ch for ch in d["changed"][0]["changes"] if ch["field"] == "headroom"}
    assert head["fp16"]["a"] - head["fp16"]["b"] == pytest.approx(10.0, abs=1e-6)
    assert head["fp8_e4m3"]["a"] > 0 > head["fp8_e4m3"]["b"]
    assert main(["diff", str(before), str(after)]) == 0
    table = capsys.readouterr().out
    rows = [line.split()[0] for line in table.splitlines()[1:-1]]
    assert set(rows) == {"a"} and "1 layer(s) changed" in table
    assert main(["diff", str(before), str(before)]) == 0
    assert "0 layer(s) changed" in capsys.readouterr().out


def test_error_changes_are_judged_against_the_noise_floor():
    a = {"plan": {"format": "fp16"}, "error": {"fp16": {"local": {"rel_l2": 1.0e-3}}}}
    same = {"plan": {"format": "fp16"}, "error": {"fp16": {"local": {"rel_l2": 1.2e-3}}}}  # within 25%
    worse = {"plan": {"format": "fp16"}, "error": {"fp16": {"local": {"rel_l2": 2.0e-3}}}}
    broken = {"plan": {"format": "fp32"}, "error": {"fp16": {"local": {"rel_l2": None}}}}
    kw = {"rel_tol": 0.25, "headroom_bits": 1.0}
    assert layer_changes("x", a, same, 0.0, **kw) == []
    assert [c["field"] for c in layer_changes("x", a, worse, 0.0, **kw)] == ["error"]
    assert layer_changes("x", a, worse, 1e-3, **kw) == [], "a change within twice the FP32 noise is noise"
    assert {c["field"] for c in layer_changes("x", a, broken, 0.0, **kw)} == {"plan", "error"}
    d = diff_audits({"layers": [{"name": "x", **a}, {"name": "gone"}]}, {"layers": [{"name": "x", **a},
                                                                                     {"name": "new"}]})
    assert d["changed"] == [] and d["added"] == ["new"] and d["removed"] == ["gone"] and d["unchanged"] == 1


def test_bad_input_is_exit_2_with_one_message(audits, tmp_path, capsys):
    before, _ = audits
    (tmp_path / "policy.json").write_text(json.dumps({"schema": "precision-audit/policy"}))
    (tmp_path / "torn.json").write_text('{"schema": "precision-audit/audit", ')
    for argv, words in ((["diff", str(before), str(tmp_path / "missing.json")], "not found"),
                        (["diff", str(before), str(tmp_path / "policy.json")], "is not an audit.json"),
                        (["diff", str(before), str(tmp_path / "torn.json")], "torn.json"),
                        (["diff", str(before), str(before), "--error-tol", "-1"], "--error-tol")):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and err.count("error:") == 1, err
