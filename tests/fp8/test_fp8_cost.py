"""The FP8 speed model (precision_audit/fp8/cost.py): FP8 GEMMs at twice BF16's rate, the added amax/cast kernels
that make small GEMMs not worth converting, the 16-element rule, and the comparison with torchao's auto_filter
thresholds (what torchtitan's float8 auto_filter uses)."""

from __future__ import annotations

import pytest
import torch

from precision_audit.fp8.cost import layer_cost, torchao_auto_filter
from precision_audit.gpus import resolve_target

H100 = resolve_target("h100")
SHAPES = [(8192, k, n) for k in (768, 1024, 2048, 4096, 8192) for n in (768, 1024, 2048, 4096, 14336, 28672)]


def test_fp8_gemms_run_at_twice_bf16_when_compute_bound():
    # tokens = in = out: the three GEMMs have the same shape, so each is a third of the BF16 time
    c = layer_cost(8192, 8192, 8192, "fp8_rowwise_gw_hp", H100)
    full = layer_cost(8192, 8192, 8192, "fp8_tensorwise", H100)
    # output and grad_input in FP8, grad_weight in BF16: 1/3 of the BF16 time saved on two of three GEMMs
    ratio = H100.peak("bf16") / H100.peak("fp8_e4m3")  # 989.4 / 1978.9 (datasheet figures)
    assert c.gemm_time_s == pytest.approx(full.bf16_time_s * (2 / 3 * ratio + 1 / 3), rel=1e-9)
    assert full.gemm_time_s == pytest.approx(full.bf16_time_s * ratio, rel=1e-9)


def test_small_gemms_do_not_pay_large_ones_do():
    assert not layer_cost(128, 256, 256, "fp8_tensorwise", H100).pays
    big = layer_cost(8192, 4096, 4096, "fp8_tensorwise", H100)
    assert big.pays and 1.2 < big.speedup < 2.0


def test_sixteen_element_rule_and_target_support():
    c = layer_cost(8192, 4104, 4096, "fp8_tensorwise", H100)
    assert not c.convertible and not c.pays and "multiples of 16" in c.note
    mx = layer_cost(8192, 4096, 4096, "mxfp8", H100)
    assert mx.time_s is None and "no Tensor Cores" in mx.note
    b200 = layer_cost(8192, 4096, 4096, "mxfp8", resolve_target("b200"))
    assert b200.pays
    assert "no FP4" in layer_cost(8192, 4096, 4096, "nvfp4", resolve_target("b200")).note


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise"])
def test_compared_with_torchao_auto_filter_on_transformer_shapes(recipe):
    """The roofline and torchao's H100 thresholds agree on most shapes, always on the large ones; they disagree
    only where a dimension is at most 2048 (docs/fp8.md, "Speed", lists where and why)."""
    verdicts = [(k, n, layer_cost(t, k, n, recipe, H100).pays, torchao_auto_filter(k, n, recipe)) for t, k, n in SHAPES]
    agree = sum(ours == theirs for _, _, ours, theirs in verdicts)
    assert agree / len(SHAPES) >= 0.75, agree
    for k, n, ours, theirs in verdicts:
        if ours != theirs:
            assert min(k, n) <= 2048, (k, n)
        if min(k, n) >= 4096:
            assert ours and theirs


def test_restated_auto_filter_equals_torchaos():
    ao = pytest.importorskip("torchao.float8.float8_linear_utils", reason="torchao is not installed")
    for _, k, n in SHAPES + [(1, 24, 16), (1, 4096, 1040)]:
        lin = torch.nn.Linear(k, n, device="meta")
        for recipe, name in (("fp8_tensorwise", "tensorwise"), ("fp8_rowwise", "rowwise")):
            assert ao._auto_filter_for_recipe(name, [])(lin, "x") == torchao_auto_filter(k, n, recipe)
