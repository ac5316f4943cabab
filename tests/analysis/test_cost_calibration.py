"""The cost model's calibration (issue 31; analysis/cost.py, docs/gpu.md "The cost model's calibration"): the
achievable shares of the datasheet peaks, checked against hand-computed cases and the measured H200 figures in
bench/README.md ("On a GPU"); the width each op would have under fp16/bf16 autocast (capture/ops.py
``AutocastWidths``); the loss, outside every module, priced in the step."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT
from precision_audit.analysis import cost
from precision_audit.analysis.cost import (
    BANDWIDTH_SHARE,
    CUDA_CORE_SHARE,
    K_HALF_AT_BF16_PEAK,
    TENSOR_CORE_SHARE,
    achievable_share,
    bytes_time,
    gemm_efficiency,
)
from precision_audit.capture.ops import AutocastWidths, GemmOp
from precision_audit.formats import Format
from precision_audit.gpus import resolve_target

H100, H200 = resolve_target("h100"), resolve_target("h200")
aten = torch.ops.aten


def _gemm(m: int, n: int, k: int, kind: str = "matmul") -> GemmOp:
    return GemmOp("mm", kind, m, n, k, 1, 2 * m * n * k, (("M", "", m), ("N", "", n), ("K", "", k)))


def test_achievable_share_by_hand():
    # bf16 on an H100, K = 1024: 0.75 x 1024 / (1024 + 290)
    assert achievable_share(_gemm(8192, 3072, 1024), Format.BF16, H100) == pytest.approx(0.75 * 1024 / 1314)
    # FP32 runs on CUDA cores: 0.85 of the FP32 peak, its half-share length scaled by 67 / 989.4 (about 19.6)
    half = 290 * 67.0 / 989.4
    assert achievable_share(_gemm(8192, 3072, 1024), Format.FP32, H100) == pytest.approx(0.85 * 1024 / (1024 + half))
    # TF32: half the BF16 peak, half the half-share length
    assert achievable_share(_gemm(64, 64, 145), Format.TF32, H100) == pytest.approx(0.75 * 145 / 290)
    # an attention's fused kernel loops over the keys (N), not the head dimension
    assert achievable_share(_gemm(512, 512, 64, "attention"), Format.BF16, H100) == pytest.approx(0.75 * 512 / 802)
    assert (TENSOR_CORE_SHARE, CUDA_CORE_SHARE, K_HALF_AT_BF16_PEAK, BANDWIDTH_SHARE) == (0.75, 0.85, 290.0, 0.80)


def test_the_h200s_measured_lm_head_gemm_is_reproduced():
    """bench/README.md, "On a GPU": the padded bf16 GEMM of 1024 x 50264 x 256 ran at 345 TFLOP/s on the H200
    (0.076 ms), the figure the half-share length is fitted to; the uncalibrated roofline said 27 us."""
    g = _gemm(1024, 50264, 256)
    t = cost._raw_gemm_time(g, Format.BF16, H200)
    assert g.flops / t / 1e12 == pytest.approx(345, rel=0.02)
    # by hand: 8 x 393 tiles of 128 x 128 over 24 waves of 132 SMs, 0.75 x 256 / 546 of 989.4 TFLOP/s
    tiles = 8 * 393
    eff = (1024 * 50264) / (tiles * 128 * 128) * tiles / (24 * 132)
    assert gemm_efficiency(g, H200) == pytest.approx(eff)
    assert t == pytest.approx(g.flops / (989.4e12 * 0.75 * 256 / 546 * eff))


def test_streaming_bytes_run_at_the_achievable_share_of_the_bandwidth():
    assert bytes_time(3.35e12, H100) == pytest.approx(1 / 0.8)  # 3.35 TB at 80% of 3.35 TB/s
    # a GEMM so thin it is memory-bound is priced at the same achievable bandwidth
    g = _gemm(8192, 8, 8192)
    nbytes = (8192 * 8192 + 8192 * 8 + 8192 * 8) * 2
    assert cost._raw_gemm_time(g, Format.BF16, H100) == pytest.approx(nbytes / (3.35e12 * 0.8))


def test_autocast_widths_follow_cuda_autocast_op_by_op():
    """A hand-made transformer-like chain, with the width each tensor has under CUDA's bf16 autocast: a GEMM
    writes 2 bytes; softmax, layer_norm and the residual stream stay fp32 (4 bytes); a GEMM's fp32 operands are
    cast first (read 4 + write 2 bytes per element)."""
    w = AutocastWidths()
    x = torch.randn(8, 16)  # the batch / residual stream: fp32
    weight = torch.randn(16, 16)

    def run(func, *args, **kwargs):
        out = func(*args, **kwargs)
        return out, w.after(func, args, kwargs, out)

    ln, (moved, cast) = run(aten.native_layer_norm.default, x, [16], None, None, 1e-5)
    assert moved == 128 * 4 + 128 * 4 + 16 * 4 and cast == 0  # fp32 in, fp32 out (mean, rstd: 8 each)
    h, (_, cast) = run(aten.mm.default, ln[0], weight)
    assert cast == (128 + 256) * 6  # the normalised input and the weight, both fp32, cast to bf16
    g, (moved, _) = run(aten.gelu.default, h)
    assert moved == 128 * 2 + 128 * 2  # follows the GEMM: bf16 in and out
    r, (moved, _) = run(aten.add.Tensor, x, g)
    assert moved == 128 * 4 + 128 * 2 + 128 * 4  # fp32 + bf16 -> fp32, as CUDA's type promotion
    s, (moved, _) = run(aten.mul.Tensor, g, torch.tensor(0.5))
    assert moved == 128 * 2 + 4 + 128 * 2  # a 0-dim fp32 scalar does not widen a bf16 tensor
    p, (moved, _) = run(aten._softmax.default, s, -1, False)
    assert moved == 128 * 2 + 128 * 4  # softmax is in autocast's fp32 list
    v, (moved, _) = run(aten.view.default, p, [128])
    c, (moved, _) = run(aten._to_copy.default, v, dtype=torch.bfloat16)
    assert moved == 128 * 4 + 128 * 2  # the view kept softmax's fp32; the explicit cast writes 2 bytes


def test_the_loss_outside_every_module_is_part_of_the_estimated_step(fake_cuda_free_session):
    cap = fake_cuda_free_session
    names = {str(g.op) for g, _ in cap.outside_ops.gemms.values()}
    assert cap.outside_ops.other_ops >= 2 and not names  # log_softmax and nll_loss, no GEMM
    assert cap.outside_ops.other_elements >= 2 * 64 * 1000  # log_softmax reads and writes the logits
    from precision_audit.analysis.performance import performance

    perf = performance(cap, H100, {}, 0, 0)
    modules = sum(lp.cost.estimated_step_time_s["fp32"] for lp in perf.layers.values() if lp.cost)
    loss = cost.layer_cost(cap.outside_ops, Format.FP32, H100, 4).step_time_s
    assert perf.step_time_s["fp32"] == pytest.approx(modules + loss)


@pytest.fixture
def fake_cuda_free_session():
    from precision_audit.capture.runner import CaptureConfig, CaptureSession

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1000))
    x, y = torch.randn(64, 32), torch.randint(0, 1000, (64,))
    with CaptureSession(model, lambda m: m(x), lambda out: F.cross_entropy(out.float(), y),
                        CaptureConfig((Format.BF16,))) as s:
        s.reference_run()
        s.format_run(Format.BF16)
        yield s.result()


def test_the_gpu_tests_gpt_is_estimated_within_20_percent_of_the_h200_measurement(monkeypatch):
    """The acceptance figure (issue 31): BF16 over FP32 on tests/gpu/test_performance_gpu.py's GPT (12 x 1024,
    16 x 512 tokens, vocabulary 50304), measured 5.36x on an H200 (bench/README.md, "On a GPU"), where the audit
    predicted 7.79x (for its target h100). The audit's accounting is reproduced on the meta device
    (bench/gpt_speedup_estimate.py): with the calibration undone it gives the GPU run's 7.79x again."""
    sys.path.insert(0, str(ROOT / "bench"))
    import gpt_speedup_estimate as est

    full, small = est.records(12, 1024, 16, 512, 50304)
    fp32, bf16 = (est.estimate(full, small, f, H200) for f in (Format.FP32, Format.BF16))
    assert fp32 / bf16 == pytest.approx(5.36, rel=0.20), f"{fp32 / bf16:.2f}x predicted on the H200"
    # before: the datasheet peaks, each module's ops at its outputs' width, no casts, no loss
    for name, value in (("TENSOR_CORE_SHARE", 1.0), ("CUDA_CORE_SHARE", 1.0), ("K_HALF_AT_BF16_PEAK", 0.0),
                        ("BANDWIDTH_SHARE", 1.0)):
        monkeypatch.setattr(cost, name, value)
    full.ops.pop(est.OUTSIDE)
    for ops in full.ops.values():
        ops.other_low_bytes.clear()
        ops.gemms = {k: (dataclasses.replace(g, cast_bytes=0), c) for k, (g, c) in ops.gemms.items()}
    fp32, bf16 = (est.estimate(full, small, f, H100) for f in (Format.FP32, Format.BF16))
    assert fp32 / bf16 == pytest.approx(7.79, rel=0.01), "the meta-device records are the audit's own"
