"""Alignment from executed shapes, FLOP counts, the roofline cost model, profiler traces and memory."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import layer
from precision_audit.analysis.alignment import EFFICIENT_MULTIPLE, REQUIRED_MULTIPLE, check_dims, padded, tile_waste_pct
from precision_audit.analysis.cost import bytes_time, gemm_time
from precision_audit.audit import AuditOptions, run_audit
from precision_audit.capture.ops import GEMM_REGISTRY, GemmOp, ModuleOps, record_op, register_gemm
from precision_audit.formats import Format
from precision_audit.gpus import resolve_target

H100 = resolve_target("h100")


def _gemm(m, n, k, batch=1):
    return GemmOp("mm", "matmul", m, n, k, batch, 2 * batch * m * n * k,
                  (("M", "rows", m), ("N", "columns", n), ("K", "reduction", k)))


@pytest.mark.parametrize("fmt, req, eff", [(Format.FP16, 8, 64), (Format.BF16, 8, 64), (Format.TF32, 4, 32),
                                           (Format.FP8_E4M3, 16, 128)], ids=str)
@pytest.mark.parametrize("size", [7, 8, 9, 63, 64, 65])
def test_alignment_rule_boundaries(fmt, req, eff, size):
    assert REQUIRED_MULTIPLE[fmt] == req and EFFICIENT_MULTIPLE[fmt] == eff
    (d,) = [d for d in check_dims(_gemm(128, size, 128), fmt, efficient_tier=True) if d.dim == "N"]
    assert d.aligned == (size % req == 0)
    assert d.suggested_size % req == 0 and size <= d.suggested_size < size + req
    assert d.efficient == (size % eff == 0)
    assert d.efficient_size % eff == 0 and size <= d.efficient_size < size + eff


def test_gpt2_vocabulary_padding():
    (d,) = [d for d in check_dims(_gemm(1024, 50257, 768), Format.BF16, True) if d.dim == "N"]
    assert d.suggested_size == 50264 and d.suggested_size % 8 == 0
    assert d.efficient_size == 50304 and d.efficient_size % 64 == 0


def test_without_efficient_tier_only_the_basic_rule_applies():
    (d,) = [d for d in check_dims(_gemm(128, 72, 128), Format.FP16, efficient_tier=False) if d.dim == "N"]
    assert d.aligned and d.efficient and d.efficient_multiple is None


def test_tile_waste_matches_the_guide_example():
    # N=136 on 128-wide tiles: two tile columns, the second holds 8/128 useful columns.
    assert tile_waste_pct(136) == pytest.approx(100 * (256 - 136) / 256)
    assert tile_waste_pct(128) == 0


def test_registry_refuses_a_second_registration():
    with pytest.raises(ValueError, match="already registered"):
        register_gemm(torch.ops.aten.mm.default, GEMM_REGISTRY[torch.ops.aten.mm.default])


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = ModuleOps()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            record_op(self.ops, func, args, kwargs or {}, out)
        return out


def _flops(fn, *args):
    with _Recorder() as r:
        fn(*args)
    return r.ops


def test_flop_counts_equal_hand_counts():
    x, w, b = torch.randn(32, 100), torch.randn(60, 100), torch.randn(60)
    assert _flops(F.linear, x, w, b).gemm_flops == 2 * 32 * 100 * 60
    img, cw = torch.randn(2, 3, 16, 16), torch.randn(8, 3, 3, 3)
    # output 2x8x14x14, each output = 3*3*3 multiply-adds
    assert _flops(F.conv2d, img, cw).gemm_flops == 2 * (2 * 8 * 14 * 14) * (3 * 3 * 3)
    a, c = torch.randn(4, 10, 20), torch.randn(4, 20, 30)
    assert _flops(torch.bmm, a, c).gemm_flops == 2 * 4 * 10 * 20 * 30
    q = torch.randn(2, 4, 16, 8)
    # QK^T: 2*B*H*L*S*E, and PV: 2*B*H*L*S*E
    ops = _flops(F.scaled_dot_product_attention, q, q, q)
    assert ops.gemm_flops == 2 * (2 * 2 * 4 * 16 * 16 * 8)
    (g, _), = ops.gemms.values()
    assert dict((d, s) for d, _, s in g.dims) == {"E": 8}


def test_roofline_big_bf16_gemm_is_at_the_calibrated_share_of_peak():
    """Issue 31: 75% of the dense peak x K / (K + 290) (analysis/cost.py's calibration), x the last wave's
    occupancy (64 x 64 tiles of 128 over 132 SMs: 32 waves, the last one 4096 - 31 x 132 = 1 tile short of full)."""
    g = _gemm(8192, 8192, 8192)
    ideal = 2 * 8192**3 / 989.4e12
    share = 0.75 * 8192 / (8192 + 290) * 4096 / (32 * 132)
    assert gemm_time(g, Format.BF16, H100) == pytest.approx(ideal / share, rel=1e-9)


def test_elementwise_is_bandwidth_bound_and_gemm_small_k_is_too():
    n = 1 << 24
    bw = 3.35e12 * 0.8  # the achievable share of the datasheet bandwidth (analysis/cost.py's calibration)
    assert bytes_time(3 * n * 2, H100) == pytest.approx(3 * n * 2 / bw, rel=1e-9)
    # a GEMM with K=1 does 2 FLOPs per output element: writing its output takes about as long as its tiles' fixed
    # cost (the calibration's K_half of 290), nothing like its 2 x 8192^2 FLOPs at the Tensor Core peak
    g = _gemm(8192, 8192, 1)
    t = gemm_time(g, Format.BF16, H100)
    memory = (8192 * 1 + 1 * 8192 + 8192 * 8192) * 2 / bw
    assert memory <= t <= 1.1 * memory and t > 100 * 2 * 8192**2 / 989.4e12


@pytest.mark.parametrize("size", [7, 9, 63, 65, 257, 1001, 50257])
@pytest.mark.parametrize("fmt", [Format.FP16, Format.BF16, Format.TF32], ids=str)
def test_misaligned_is_never_estimated_faster_than_padded(size, fmt):
    for g in (_gemm(4096, size, 1024), _gemm(size, 4096, 1024), _gemm(2048, 2048, size), _gemm(8, size, 8)):
        assert gemm_time(g, fmt, H100) >= gemm_time(padded(g, fmt), fmt, H100)


X_AT_W = textwrap.dedent("""
    import torch
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 1001) * 0.03)
        def forward(self, x):
            return x @ self.w.T          # K = 1001, written inside forward, no nn.Linear
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Odd()
            self.head = torch.nn.Linear(64, 8)
        def forward(self, x):
            return self.head(self.proj(x))
    def build_model():
        torch.manual_seed(0)
        return Net()
    def sample_batch():
        return torch.randn(16, 1001, generator=torch.Generator().manual_seed(0))
""")


def test_matmul_inside_forward_is_found_and_attributed(tmp_path):
    (tmp_path / "odd.py").write_text(X_AT_W)
    a = run_audit(AuditOptions(model=str(tmp_path / "odd.py"), out=tmp_path / "out", steps=0)).audit
    proj = layer(a, "proj")
    ks = [d for f in proj["alignment"] for d in f["dims"] if d["dim"] == "K" and d["format"] == "bf16"]
    assert ks and ks[0]["size"] == 1001 and ks[0]["suggested_size"] == 1008 and not ks[0]["aligned"]
    assert proj["cost"]["flops"] == 2 * 16 * 1001 * 64
    # attributed to the module whose forward ran it, not to its parent or a sibling
    assert not any(d["size"] == 1001 for f in layer(a, "")["alignment"] or [] for d in f["dims"])


def test_tiny_gpt_lm_head_vocabulary_is_named_with_padding_and_saving(sample_audits):
    result, out, _ = sample_audits.get("tiny_gpt")
    a = json.loads((out / "audit.json").read_text())
    head = layer(a, "lm_head")
    finding = next(f for f in head["alignment"] if any(d["size"] == 257 for d in f["dims"]))
    d = next(d for d in finding["dims"] if d["size"] == 257 and d["format"] == "bf16")
    assert d["suggested_size"] == 264 and d["efficient_size"] == 320
    assert finding["estimated_saving_s"]["bf16"] > 0
    assert "257" in finding.get("vocabulary_advice", "") or d["name"]
    html = (out / "report.html").read_text()
    assert "lm_head" in html and "264" in html


def test_estimates_are_labelled_and_bf16_beats_fp32(sample_audits):
    a = sample_audits.audit_json("tiny_gpt", steps=1)  # timed steps are off by default in emulated mode
    est = a["estimates"]
    assert est["kind"] == "estimate" and est["target"] == "H100 SXM"
    assert est["speedup_vs_fp32"]["bf16"] > 1 and est["speedup_vs_fp32"]["tf32"] > 1
    for f in ("fp32", "fp16", "bf16"):
        st = a["summary"][f]["step_time"]
        assert st["estimated_s"] > 0 and "estimate" in st["estimated_note"]
        assert st["measured_s"] > 0 and "CPU" in st["measured_on"]


def test_profiler_traces_are_written_and_hold_events_for_each_format(sample_audits):
    _, out, _ = sample_audits.get("mlp", steps=1, trace=True)  # timed steps are off by default in emulated mode
    a = json.loads((out / "audit.json").read_text())
    files = a["traces"]["files"]
    for fmt in ("fp32", "fp16", "bf16"):
        mine = [f for f in files if f.startswith(f"tb/{fmt}/")]
        assert mine, f"no trace for {fmt}"
        trace = json.loads((out / mine[0]).read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "module::fc1" in names, f"{fmt}: module ranges missing from the trace"
        assert any(n and n.startswith("aten::") for n in names), f"{fmt}: no op events"


def test_memory_parameters_gradients_optimizer_exact_and_activations_near_hand_count(sample_audits):
    a = sample_audits.audit_json("mlp")
    n = (64 * 128 + 128) + (128 * 128 + 128) + (128 * 16 + 16)
    m = a["memory"]["per_format"]["fp32"]
    assert m["parameters_bytes"] == 4 * n and m["gradients_bytes"] == 4 * n
    assert m["optimizer_bytes"] == {"adam": 8 * n, "sgd_momentum": 4 * n, "sgd": 0}
    # saved for backward in FP32: the input of fc1 [32, 64], relu's output, fc2's output (GELU's input),
    # GELU's output (head's input), log_softmax's output [32, 16]
    hand = 4 * (32 * 64 + 3 * 32 * 128 + 32 * 16)
    assert m["saved_activation_bytes"] == pytest.approx(hand, rel=0.10)
    low = a["memory"]["per_format"]["bf16"]["saved_activation_bytes"]
    assert low < m["saved_activation_bytes"], "bf16 activations take fewer bytes"
    assert a["memory"]["advice"]


def test_layer_costs_and_the_loss_add_up_to_the_step_estimate(sample_audits):
    """The loss runs outside every module: it is in the step, in no layer, and the assumptions say how much."""
    import re

    a = sample_audits.audit_json("cnn")
    line = next(s for s in a["estimates"]["assumptions"] if s.startswith("the ops outside the model's modules"))
    loss = {f: float(v) * 1e-6 for f, v in re.findall(r"(\w+) ([0-9.e+-]+) µs", line)}
    for f in ("fp32", "bf16"):
        total = sum((L["cost"] or {}).get("estimated_step_time_s", {}).get(f, 0.0) for L in a["layers"])
        assert loss[f] > 0
        assert total + loss[f] == pytest.approx(a["estimates"]["step_time_s"][f], rel=1e-5)
