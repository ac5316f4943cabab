"""Per-layer FP8 measurement (precision_audit/fp8/measure.py) and the emulated linear (fp8/linear.py): bit-exact
against torchao's own Float8Linear (emulate=True), and issue 16's planted model: tensorwise FP8 fails on both
planted layers, rowwise repairs only the outlier-token one, MXFP8 and BF16 are fine for the outlier-channel one."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util

import pytest
import torch

from conftest import ROOT
from precision_audit.fp8.linear import Fp8State, fp8_linear, patched
from precision_audit.fp8.measure import measure_fp8, result_record
from precision_audit.fp8.recipes import RECIPES

try:
    import torchao  # noqa: F401
    HAVE_TORCHAO = True
except Exception:  # pragma: no cover
    HAVE_TORCHAO = False
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed (pip install '.[fp8]')")


def _planted():
    spec = importlib.util.spec_from_file_location("fp8_outliers", ROOT / "sample_models" / "fp8_outliers" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_torchao
@pytest.mark.parametrize("ours,theirs", [("fp8_tensorwise", "tensorwise"), ("fp8_rowwise", "rowwise"),
                                         ("fp8_rowwise_gw_hp", "rowwise_with_gw_hp")])
def test_emulated_linear_equals_torchao_float8linear(ours, theirs):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(2, 8, 64)
    x[0, 3] *= 1e4  # an outlier token
    x[1, :, 7] *= 1e3  # an outlier channel
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(theirs), emulate=True)
    ao = convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(lin)), config=cfg)
    assert type(ao[0]).__name__ == "Float8Linear"
    xa = x.clone().requires_grad_()
    ya = ao(xa)
    g = torch.randn_like(ya)
    ya.backward(g)
    ref = copy.deepcopy(lin)
    xb = x.clone().requires_grad_()
    yb = fp8_linear(xb, ref.weight, ref.bias, Fp8State(RECIPES[ours]))
    yb.backward(g)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(ao[0].weight.grad, ref.weight.grad)
    assert torch.equal(ao[0].bias.grad, ref.bias.grad)


def test_emulated_linear_is_not_plain_fp32():
    """The emulation changes the numbers (a test of the quantisation, not of F.linear)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16)
    x = torch.randn(4, 32)
    y = fp8_linear(x, lin.weight, lin.bias, Fp8State(RECIPES["fp8_tensorwise"]))
    assert not torch.equal(y, lin(x))
    assert torch.allclose(y, lin(x), rtol=0.2, atol=0.1)


@pytest.fixture(scope="module")
def planted():
    mod = _planted()
    model = mod.build_model()
    x, t = mod.sample_batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = measure_fp8(model, lambda m: m(x), lambda o: mod.loss_fn(o, (x, t)),
                    ("fp8_tensorwise", "fp8_rowwise", "mxfp8", "fp8_delayed"), history_steps=2)
    return mod, model, (x, t), before, result_record(r, 0.05)


def _rec(d, layer, recipe):
    return next(L for L in d.layers if L.name == layer).recipes[recipe]


def test_planted_tensorwise_fails_on_both_layers(planted):
    d = planted[4]
    tok = _rec(d, "tokens", "fp8_tensorwise")
    ch = _rec(d, "channels", "fp8_tensorwise")
    assert not tok.meets_budget and not ch.meets_budget
    # outlier tokens hide in the whole-tensor error; the per-token error shows the ordinary tokens lost
    assert tok.local["output"].rel_l2 < 0.05 < 0.3 < tok.local_per_token_rel_l2
    assert ch.local["output"].rel_l2 > 0.3
    # why: the per-tensor scale is set by the outliers and the rest flushes to zero
    assert tok.operands["output.input"].flushed_share > 0.5
    assert ch.operands["output.input"].flushed_share > 0.5
    # the scale chosen is fp8_max / amax
    x = planted[2][0]
    assert tok.operands["output.input"].scale_max == pytest.approx(448.0 / float(x.abs().max()), rel=1e-6)


def test_planted_rowwise_repairs_only_the_outlier_tokens(planted):
    d = planted[4]
    tok = _rec(d, "tokens", "fp8_rowwise")
    ch = _rec(d, "channels", "fp8_rowwise")
    assert tok.meets_budget and tok.local_per_token_rel_l2 < 0.05
    assert tok.operands["output.input"].flushed_share < 1e-3  # only values near 0 of a Gaussian
    assert not ch.meets_budget and ch.local["output"].rel_l2 > 0.3


def test_planted_mxfp8_and_bf16_fine_for_outlier_channels(planted):
    mod, model, (x, _), _, d = planted
    ch = _rec(d, "channels", "mxfp8")
    assert ch.meets_budget and ch.local["output"].rel_l2 < 0.05
    assert ch.operands["output.input"].saturated_share == 0.0
    # BF16, as the audit's emulated CUDA autocast computes it, on the same inputs
    from precision_audit.capture.stats import ErrorStats
    from precision_audit.emulation.autocast import CudaAutocastPolicy, emulated_autocast
    with torch.no_grad():
        h = model.tokens(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * model.gain
        ref = model.channels(h)
        with CudaAutocastPolicy("python"), emulated_autocast(torch.bfloat16, None):
            y = model.channels(h)
    assert y.dtype == torch.bfloat16
    e = ErrorStats()
    e.update(ref, y)
    assert e.rel_l2 < 0.05


def test_planted_ordinary_layer_is_fine_in_fp8(planted):
    d = planted[4]
    for r in ("fp8_tensorwise", "fp8_rowwise", "mxfp8"):
        assert _rec(d, "head", r).meets_budget


def test_delayed_scaling_reports_stale_steps(planted):
    d = planted[4]
    # step 0 runs at TE's initial scale 1: the 2^17 outlier inputs saturate it; later steps use the history
    assert _rec(d, "tokens", "fp8_delayed").stale_steps["input"] == [0]
    assert _rec(d, "head", "fp8_delayed").stale_steps["input"] == []


def test_model_is_put_back(planted):
    mod, model, _, before, _ = planted
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in model.parameters())
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_patched_restores_forward_after_an_error():
    lin = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError):
        with patched({lin: Fp8State(RECIPES["fp8_tensorwise"])}):
            assert "forward" in lin.__dict__
            raise RuntimeError("boom")
    assert "forward" not in lin.__dict__


def test_the_fp8_stage_puts_the_callers_generators_back():
    """The stage reseeds torch's, Python's and NumPy's generators for every measurement (so that a forward that
    draws masks draws the same in each); a caller of the Python API finds them as they were."""
    import random

    import numpy as np

    from precision_audit.analysis.findings import Budget
    from precision_audit.fp8.audit import fp8_stage
    from precision_audit.gpus import resolve_target

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, 16))
    x = torch.randn(16, 32)
    torch.manual_seed(7)
    random.seed(8)
    np.random.seed(9)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    fp8_stage(model, lambda m: m(x), lambda y: y.pow(2).mean(), resolve_target("h100"), Budget())
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1] and np.array_equal(np.random.get_state()[1], before[2])
