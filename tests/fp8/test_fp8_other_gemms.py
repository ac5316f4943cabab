"""GEMMs outside nn.Linear (precision_audit/fp8/other_gemms.py, docs/fp8.md): every matmul/bmm a module's forward
makes is measured under each recipe, against a hand computation with the same quantisers, attributed to its
module, reported in audit.json's fp8 section, and never planned (torchao converts only nn.Linear)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from precision_audit.capture.stats import ErrorStats
from precision_audit.fp8 import quant as Q
from precision_audit.fp8.measure import measure_fp8, result_record
from precision_audit.fp8.other_gemms import NOT_PLANNED
from precision_audit.record.fp8 import Fp8PlanReport

OUTLIER = 2.0 ** 12


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        s = torch.bmm(q, k.transpose(1, 2)) / 32 ** 0.5
        return torch.softmax(s, -1) @ v


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attn()
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(self.attn(x))


def test_matmul_and_bmm_are_measured_per_module_and_refused_in_the_plan():
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 32, generator=g)
    x[0, 3] *= OUTLIER  # one outlier token: tensorwise scaling flushes the others' scores
    y = torch.randn(2, 16, 8, generator=g)
    r = measure_fp8(model, lambda m: m(x), lambda o: F.mse_loss(o, y),
                    ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise", "mxfp8"), history_steps=1)
    found = {(o.module, o.op): o for o in r.other_gemms}
    assert set(found) == {("attn", "bmm"), ("attn", "matmul")}  # nothing from the two nn.Linear
    bmm = found[("attn", "bmm")]
    assert bmm.a_shape == (2, 16, 32) and bmm.b_shape == (2, 32, 16) and bmm.calls == 1
    assert bmm.flops == 2 * 2 * 16 * 16 * 32
    # hand reference: the FP32 scores, and the same scores from tensorwise / rowwise quantised operands
    with torch.no_grad():
        q, k, _ = model.attn.qkv(x).chunk(3, dim=-1)
        kt = k.transpose(1, 2)
        ref = torch.bmm(q, kt)
        for recipe, quant in (("fp8_tensorwise", lambda t, d: Q.quantize_tensorwise(t, Q.E4M3).values),
                              ("fp8_rowwise", lambda t, d: Q.quantize_axiswise(t, Q.E4M3, d, True).values),
                              ("mxfp8", lambda t, d: Q.quantize_mx(t, Q.E4M3, 32, d).values)):
            e = ErrorStats()
            e.update(ref, torch.bmm(quant(q, -1), quant(kt, -2)))
            assert bmm.recipes[recipe].rel_l2 == e.rel_l2, recipe
    # one scale for the whole of Q, set by the outlier token, flushes small values of the other tokens; a scale per
    # row (rowwise) does not
    tw, rw = bmm.operands["fp8_tensorwise"]["a"], bmm.operands["fp8_rowwise"]["a"]
    assert tw.flushed > 10 * max(rw.flushed, 1)
    d = result_record(r, 0.05).other_gemms
    assert [(o.module, o.op) for o in d] == [("attn", "bmm"), ("attn", "matmul")]
    assert all(o.plan == NOT_PLANNED for o in d)
    assert d[0].recipes["fp8_delayed"].note.startswith("not measured")
    assert d[0].recipes["fp8_tensorwise"].operands["output.a"].flushed == tw.flushed
    assert [L.name for L in r.layers] == ["attn.qkv", "head"]


def test_a_model_without_functional_gemms_has_none():
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(8, 16)
    r = measure_fp8(model, lambda m: m(x), lambda o: o.square().mean(), ("fp8_tensorwise",), history_steps=1)
    assert r.other_gemms == [] and result_record(r, 0.05).other_gemms == []


def test_report_lists_them_in_the_fp8_section():
    from precision_audit.fp8.report import fp8_view
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(2, 16, 32)
    r = measure_fp8(model, lambda m: m(x), lambda o: o.square().mean(), ("fp8_tensorwise", "mxfp8"),
                    history_steps=1)
    section = result_record(r, 0.05)
    section.plan = Fp8PlanReport(modules={}, fp8_flop_share=0.0, estimated_linear_speedup_vs_bf16=None,
                                 tokens_per_step={"attn.qkv": 4096, "head": 4096}, verified=None,
                                 dropped_for_budget=[])
    v = fp8_view(section)
    assert v is not None and v["tokens_per_step"] == "4096"
    assert [row["name"] for row in v["other"]] == ["attn bmm #0", "attn matmul #0"]
    assert v["other"][0]["shape"] == "2x16x32 @ 2x32x16"
    assert set(v["other"][0]["cells"]) == {"fp8_tensorwise", "mxfp8"}
    assert v["other"][0]["reason"] == NOT_PLANNED
