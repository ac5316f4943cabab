"""Emulated CUDA autocast on CPU (emulation/autocast.py; DESIGN §3, NUMERICS §1-3).

1. Faithfulness per op: under ``CudaAutocastPolicy()`` + ``emulated_autocast(dt)``, each op's value equals the op
   computed in the real low-precision format with fp32 accumulation (a float64 brute force on the rounded
   inputs, and the CPU-native fp16/bf16 kernel where that kernel rounds once): bit-identical for
   elementwise/normalisation ops, within one ulp of the format (plus the fp32 summation-order bound) for the
   GEMM family. The autocast path and the LowPrecisionGemmMode path agree bit for bit.
2. Gradients of linear and conv2d through the emulated forward: fp32 .grad, rounded to the low dtype, within
   one ulp of a float64 brute force (and of the native low-precision backward for linear).
3. Dtype policy op by op from ``CUDA_POLICY``: what the table implies (each recipe must reach its op's
   AutocastCPU kernel), and what the real AutocastCUDA kernels decide (an oracle on fake CUDA tensors, run in a
   subprocess: NUMERICS §1.4 option B).
4. The table against the installed torch.

Known disagreements with CUDA are strict xfails (the reason says what CUDA does): nn.LSTM/nn.GRU, which CUDA
lowers through cuDNN's own autocast wrapper (listed in emulation.KNOWN_GAPS).

Run as a script (``python tests/emulation/test_emulation.py --oracle``) this file is the oracle's subprocess.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from precision_audit.emulation import autocast as emulation
from precision_audit.emulation.autocast import (
    FP32_COMPUTE_OPS,
    CudaAutocastPolicy,
    LowPrecisionGemmMode,
    _resolve,
    emulated_autocast,
)
from precision_audit.emulation.autocast_policy import (
    CUDA_POLICY,
    UNMODELLED,
    CastPolicy,
    check_registrations,
    installed_policy,
    registered_cuda_autocast_ops,
)

F32 = torch.float32
FP16, BF16 = torch.float16, torch.bfloat16
DTYPES = [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16")]
DTYPE_NAMES = {FP16: "fp16", BF16: "bf16"}
MANTISSA_BITS = {FP16: 10, BF16: 7}
U32 = 2.0 ** -24  # unit roundoff of the fp32 accumulator
MAX_DIFF_FRACTION = 0.01  # GEMM family: at most 1% of elements may differ (by <= 1 ulp) from a reference
# (measured: fp16 ~0.1-0.3%, bf16 ~0-0.02%; DESIGN §3 quotes 99.8% / 99.99% bit-identical for linear)


# ------------------------------------------------------------------------------------------- helpers


def ulp(ref: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Spacing of ``dt`` at |ref| (float64): 2^(floor(log2|ref|) - mantissa_bits).

    Below the smallest normal number (zeros and subnormals included) the spacing is the subnormal step
    2^(emin - mantissa_bits): 2^-24 for fp16, 2^-133 for bf16.
    """
    mag = ref.double().abs().clamp_min(torch.finfo(dt).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - MANTISSA_BITS[dt])


def assert_within_ulp(emu: torch.Tensor, ref: torch.Tensor, dt: torch.dtype, what: str, *,
                      acc_bound: torch.Tensor | None = None, max_fraction: float = MAX_DIFF_FRACTION) -> None:
    """|emu - ref| <= 1 ulp(ref) (+ ``acc_bound``: how far two fp32 summation orders may drift apart)."""
    assert emu.dtype == dt, f"{what}: emulated result is {emu.dtype}, CUDA autocast gives {dt}"
    assert ref.dtype == dt, f"{what}: reference is {ref.dtype}, expected {dt} (test bug)"
    assert emu.shape == ref.shape, f"{what}: shape {tuple(emu.shape)} vs reference {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(emu)), f"{what}: inf/nan pattern differs from the reference"
    assert torch.equal(emu[~finite].double().nan_to_num(), ref[~finite].double().nan_to_num()), \
        f"{what}: non-finite values differ from the reference"
    e, r = emu[finite].double(), ref[finite].double()
    u = ulp(r, dt)
    allowed = u + (acc_bound.double()[finite] if acc_bound is not None else 0.0)
    diff = (e - r).abs()
    bad = diff > allowed
    if bad.any():
        i = int(torch.argmax((diff - allowed) / u))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{r.numel()} elements are more than 1 ulp of {dt} (+ the fp32 "
            f"accumulation bound) from a reference computed in real {dt} with fp32 accumulation; worst: "
            f"emulated {e[i].item():.9g} vs reference {r[i].item():.9g} = {(diff[i] / u[i]).item():.1f} ulp, "
            f"allowed {(allowed[i] / u[i]).item():.2f} ulp")
    fraction = (diff > 0).double().mean().item()
    assert fraction <= max_fraction, (
        f"{what}: {fraction:.2%} of elements differ from the reference (each by <= 1 ulp); a faithful "
        f"fp32-accumulation emulation differs only by summation order, on < {max_fraction:.0%} of elements")


def assert_bitwise_equal(emu: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert emu.dtype == ref.dtype, f"{what}: emulated dtype {emu.dtype}, CUDA autocast gives {ref.dtype}"
    assert emu.shape == ref.shape, f"{what}: shape {tuple(emu.shape)} vs reference {tuple(ref.shape)}"
    int_view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[emu.element_size()]
    differ = emu.contiguous().view(int_view) != ref.contiguous().view(int_view)
    if differ.any():
        i = int(differ.flatten().nonzero()[0])
        raise AssertionError(
            f"{what}: {int(differ.sum())}/{emu.numel()} elements are not bit-identical to the op run in the "
            f"dtype CUDA's policy picks ({ref.dtype}); first: {emu.flatten()[i].item()!r} vs "
            f"{ref.flatten()[i].item()!r}")


def exact_rounded(fn: Callable[..., torch.Tensor], dt: torch.dtype, *tensors: torch.Tensor, **kw) -> torch.Tensor:
    """fn on the dt-rounded inputs, computed in float64 and rounded once: Tensor Core numerics without the
    fp32 accumulation error (the brute-force reference)."""
    return fn(*(t.to(dt).double() for t in tensors), **kw).to(dt)


def abs_terms(fn: Callable[..., torch.Tensor], dt: torch.dtype, *tensors: torch.Tensor, **kw) -> torch.Tensor:
    """For an op that is linear in each input (GEMM, conv): fn on |inputs| = the sum of |products| per output."""
    return fn(*(t.to(dt).double().abs() for t in tensors), **kw)


def gemm_bound(sum_abs: torch.Tensor, k: int) -> torch.Tensor:
    """Two fp32 summations of the same k products can differ by up to 2*k*u32*sum|products| (each is within
    gamma_k*sum|products| of the exact sum). Only elements with heavy cancellation get near one ulp of it."""
    return 2 * k * U32 * sum_abs


@pytest.fixture
def cuda_policy():
    with CudaAutocastPolicy() as policy:
        yield policy


def test_ulp_helper_matches_the_formats() -> None:
    assert ulp(torch.tensor([1.0, 1.5, 2.0, 65504.0, 0.0, 2.0 ** -20]), FP16).tolist() == \
        [2.0 ** -10, 2.0 ** -10, 2.0 ** -9, 32.0, 2.0 ** -24, 2.0 ** -24]
    assert ulp(torch.tensor([1.0, 3.0, 0.0, 2.0 ** -130]), BF16).tolist() == \
        [2.0 ** -7, 2.0 ** -6, 2.0 ** -133, 2.0 ** -133]
    for dt in (FP16, BF16):
        one = torch.tensor([1.0], dtype=dt)
        assert (torch.nextafter(one, one + 1) - one).double().item() == ulp(one, dt).item()


# ----------------------------------------------------------------------- 1. faithfulness per op (forward)


@pytest.mark.parametrize("dt", DTYPES)
def test_linear_matches_low_precision_gemm(cuda_policy, dt) -> None:
    x = torch.randn(64, 96)
    layer = torch.nn.Linear(96, 80)
    with emulated_autocast(dt):
        y = layer(x)
    w, b = layer.weight.detach(), layer.bias.detach()
    bound = gemm_bound(abs_terms(F.linear, dt, x, w, b), 96 + 1)
    native = F.linear(x.to(dt), w.to(dt), b.to(dt))  # CPU-native fp16/bf16 kernel, fp32 accumulation
    assert_within_ulp(y, native, dt, "linear vs native CPU kernel", acc_bound=bound)
    assert_within_ulp(y, exact_rounded(F.linear, dt, x, w, b), dt, "linear vs float64 brute force", acc_bound=bound)


@pytest.mark.parametrize("dt", DTYPES)
def test_conv2d_matches_low_precision_conv(cuda_policy, dt) -> None:
    x = torch.randn(2, 8, 16, 16)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    with emulated_autocast(dt):
        y = conv(x)
    w, b = conv.weight.detach(), conv.bias.detach()
    # CUDA runs cuDNN without the bias and adds it in a second kernel: two roundings (emulation._CONV_OPS). The
    # first rounding may differ by an ulp of the bias-less result, which the bias add can leave in place.
    conv_only = exact_rounded(F.conv2d, dt, x, w, padding=1)
    bound = gemm_bound(abs_terms(F.conv2d, dt, x, w, padding=1), 8 * 9) + ulp(conv_only, dt)
    bias = b.to(dt).view(1, -1, 1, 1)
    native = F.conv2d(x.to(dt), w.to(dt), None, padding=1) + bias
    assert_within_ulp(y, native, dt, "conv2d vs native CPU kernel", acc_bound=bound)
    assert_within_ulp(y, (conv_only.double() + bias.double()).to(dt), dt, "conv2d vs float64 brute force",
                      acc_bound=bound)


@pytest.mark.parametrize("dt", DTYPES)
def test_bmm_matches_low_precision_gemm(cuda_policy, dt) -> None:
    a, b = torch.randn(4, 32, 48), torch.randn(4, 48, 40)
    with emulated_autocast(dt):
        y = torch.bmm(a, b)
    bound = gemm_bound(abs_terms(torch.bmm, dt, a, b), 48)
    assert_within_ulp(y, torch.bmm(a.to(dt), b.to(dt)), dt, "bmm vs native CPU kernel", acc_bound=bound)
    assert_within_ulp(y, exact_rounded(torch.bmm, dt, a, b), dt, "bmm vs float64 brute force", acc_bound=bound)


@pytest.mark.parametrize("dt", DTYPES)
def test_matmul_operator_matches_low_precision_gemm(cuda_policy, dt) -> None:
    x, w = torch.randn(2, 64, 96), torch.randn(96, 80)  # `x @ w` in user code: aten::matmul, 3-D @ 2-D
    with emulated_autocast(dt):
        y = x @ w
    bound = gemm_bound(abs_terms(torch.matmul, dt, x, w), 96)
    assert_within_ulp(y, x.to(dt) @ w.to(dt), dt, "matmul vs native CPU kernel", acc_bound=bound)
    assert_within_ulp(y, exact_rounded(torch.matmul, dt, x, w), dt, "matmul vs float64 brute force",
                      acc_bound=bound)


def _attention_probs(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dt", DTYPES)
def test_sdpa_matches_low_precision_attention(cuda_policy, dt, causal) -> None:
    q, k, v = torch.randn(3, 2, 4, 32, 16).unbind(0)
    with emulated_autocast(dt):
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    qd, kd, vd = (t.to(dt).double() for t in (q, k, v))
    p = _attention_probs(qd, kd, causal)
    p_abs_v = p @ vd.abs()
    # fp32 errors: q.k (d terms) moves the logits by <= d*u32*max|q||k|*scale, which moves P relatively by
    # about as much; exp/sum of L terms and the P@V sum (L terms) add ~L*u32.
    d_head, length = q.shape[-1], q.shape[-2]
    smax = ((qd.abs() @ kd.abs().transpose(-1, -2)) / math.sqrt(d_head)).amax()
    bound = 2 * (d_head * smax + 4 * length) * U32 * p_abs_v
    ref = (p @ vd).to(dt)
    assert_within_ulp(y, ref, dt, f"sdpa(causal={causal}) vs float64 brute force", acc_bound=bound)
    # The CPU-native fp16/bf16 kernel (like FlashAttention on a GPU) also rounds the probabilities P to the low
    # dtype before the P@V GEMM, which the emulation does not model: the two agree within that rounding.
    native = F.scaled_dot_product_attention(q.to(dt), k.to(dt), v.to(dt), is_causal=causal)
    u_low = 2.0 ** -(MANTISSA_BITS[dt] + 1)
    assert_within_ulp(y, native, dt, f"sdpa(causal={causal}) vs native CPU kernel (P rounded to {dt})",
                      acc_bound=bound + 4 * u_low * p_abs_v, max_fraction=1.0)


@pytest.mark.parametrize("dt", DTYPES)
def test_layer_norm_runs_in_fp32_bitwise(cuda_policy, dt) -> None:
    x = torch.randn(8, 32, 96).to(dt)  # e.g. the output of an autocast linear
    ln = torch.nn.LayerNorm(96)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    with emulated_autocast(dt):
        y = ln(x)
    assert_bitwise_equal(y, F.layer_norm(x.float(), (96,), ln.weight, ln.bias), "layer_norm (CUDA policy: fp32)")


@pytest.mark.parametrize("dt", DTYPES)
def test_softmax_runs_in_fp32_bitwise(cuda_policy, dt) -> None:
    x = (torch.randn(2, 4, 32, 32) * 4).to(dt)  # attention scores
    with emulated_autocast(dt):
        y = F.softmax(x, dim=-1)
    assert_bitwise_equal(y, F.softmax(x.float(), dim=-1), "softmax (CUDA policy: fp32_set_opt_dtype)")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dt", DTYPES)
def test_gelu_runs_in_input_dtype_bitwise(cuda_policy, dt, approximate) -> None:
    x = (torch.randn(64, 96) * 3).to(dt)
    with emulated_autocast(dt):
        y = F.gelu(x, approximate=approximate)
    assert_bitwise_equal(y, F.gelu(x, approximate=approximate), f"gelu({approximate}) (unlisted: input dtype)")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1], ids=["plain", "smoothed"])
@pytest.mark.parametrize("dt", DTYPES)
def test_cross_entropy_matches_the_cuda_composite_bitwise(cuda_policy, dt, label_smoothing) -> None:
    """cross_entropy is not itself in CUDA's list: the composite ``cross_entropy_loss`` (LossNLL.cpp) calls
    ``log_softmax(x, 1, dtype=x.scalar_type())``, an explicit dtype that fp32_set_opt_dtype respects, so the
    log-probabilities stay fp16/bf16; only ``nll_loss`` (fp32) and the smoothing ``sum`` (fp32_set_opt_dtype)
    go to fp32. (Checked with the real AutocastCUDA kernels on fake CUDA: ``_log_softmax`` runs on and
    returns float16 there.) So the loss is NOT log_softmax+nll computed in fp32."""
    logits = (torch.randn(64, 100) * 3).to(dt)
    target = torch.randint(100, (64,))
    with emulated_autocast(dt):
        loss = F.cross_entropy(logits, target, label_smoothing=label_smoothing)
    logp = F.log_softmax(logits, 1)  # in dt, as on CUDA
    assert logp.dtype == dt
    ref = F.nll_loss(logp.float(), target)
    if label_smoothing:
        smooth = -logp.sum(1, dtype=F32)
        ref = ref * (1 - label_smoothing) + smooth.sum() / target.numel() * (label_smoothing / logits.shape[1])
    assert_bitwise_equal(loss, ref, "cross_entropy (CUDA: log_softmax in the input dtype, nll_loss in fp32)")
    all_fp32 = F.cross_entropy(logits.float(), target, label_smoothing=label_smoothing)
    assert loss.item() != all_fp32.item(), (
        "the emulated loss equals log_softmax computed in fp32; CUDA keeps log_softmax in the input dtype here "
        "(a tie is possible in principle, but not for these seeded inputs)")


# -------------------------------------------------------------------------------- 2. gradients


def _rounded_to(t: torch.Tensor, dt: torch.dtype) -> bool:
    return torch.equal(t.to(dt).to(t.dtype), t)


GRAD_LAYERS = {
    # name: (module factory, input shape, functional form, reduction length per gradient,
    #        whether the CPU-native low-precision backward is a valid reference)
    "linear": (lambda: torch.nn.Linear(96, 80), (64, 96), F.linear, {"input": 80, "weight": 64, "bias": 64}, True),
    # CPU-native fp16/bf16 conv backward is NOT "fp32 accumulation, one rounding" (it accumulates partial
    # results in the low dtype: up to ~1500 ulp off on ~60% of dinput elements), unlike cuDNN's dgrad/wgrad,
    # so conv gradients are checked against the float64 brute force only.
    "conv2d": (lambda: torch.nn.Conv2d(8, 16, 3, padding=1), (2, 8, 16, 16),
               lambda x, w, b: F.conv2d(x, w, b, padding=1),
               {"input": 16 * 9, "weight": 2 * 16 * 16, "bias": 2 * 16 * 16}, False),
}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("layer_name", list(GRAD_LAYERS))
def test_gradients_match_low_precision_backward(cuda_policy, layer_name, dt) -> None:
    make, shape, fn, k, native_is_reference = GRAD_LAYERS[layer_name]
    layer = make()
    x = torch.randn(shape, requires_grad=True)
    with emulated_autocast(dt):
        y = layer(x)
    assert y.dtype == dt
    g = torch.randn(y.shape).to(dt)
    y.backward(g)  # outside autocast, as in a training loop
    emulated = {"input": x.grad, "weight": layer.weight.grad, "bias": layer.bias.grad}
    for name, grad in emulated.items():
        assert grad.dtype == F32, f"{layer_name}.{name}.grad is {grad.dtype}; CUDA autocast leaves fp32 grads"
        # On a GPU dgrad/wgrad are fp16/bf16 GEMM outputs, cast to fp32 by the cast's backward.
        assert _rounded_to(grad, dt), \
            f"{layer_name}.{name}.grad is not rounded to {dt} as CUDA's low-precision GEMM output is"

    # Reference 1: torch.autograd through the CPU-native fp16/bf16 kernels (fp32 accumulation).
    leaves = [t.detach().to(dt).requires_grad_() for t in (x, layer.weight, layer.bias)]
    fn(*leaves).backward(g)
    native = dict(zip(emulated, (t.grad for t in leaves)))
    # Reference 2: float64 autograd on the rounded inputs, rounded once.
    leaves64 = [t.detach().to(dt).double().requires_grad_() for t in (x, layer.weight, layer.bias)]
    fn(*leaves64).backward(g.double())
    exact = dict(zip(emulated, (t.grad.to(dt) for t in leaves64)))
    # Sum of |products| per gradient element: the same backward with every operand replaced by its |.|.
    leaves_abs = [t.detach().to(dt).double().abs().requires_grad_() for t in (x, layer.weight, layer.bias)]
    fn(*leaves_abs).backward(g.double().abs())
    sum_abs = dict(zip(emulated, (t.grad for t in leaves_abs)))
    for name, grad in emulated.items():
        bound = gemm_bound(sum_abs[name], k[name])
        assert_within_ulp(grad.to(dt), exact[name], dt, f"{layer_name} d{name} vs float64 brute force",
                          acc_bound=bound)
        if native_is_reference:
            assert_within_ulp(grad.to(dt), native[name], dt, f"{layer_name} d{name} vs native {dt} backward",
                              acc_bound=bound)
        else:  # the emulation is at least as close to one-rounding numerics as the CPU-native kernel
            err_emu = (grad.double() - exact[name].double()).abs().max()
            err_native = (native[name].double() - exact[name].double()).abs().max()
            assert err_emu <= err_native, f"{layer_name} d{name}: emulated error {err_emu} > CPU-native {err_native}"


@pytest.mark.parametrize("dt", DTYPES)
def test_gemm_mode_emulates_already_low_precision_gemms_forward_and_backward(dt) -> None:
    """LowPrecisionGemmMode: fp16/bf16 tensors outside autocast's reach (a model cast with .half()), kept
    active through backward(): GEMMs in fp32 rounded once, matching the native low-precision kernels."""
    x = torch.randn(64, 96).to(dt).requires_grad_()
    w = torch.randn(80, 96).to(dt).requires_grad_()
    g = torch.randn(64, 80).to(dt)
    mode = LowPrecisionGemmMode()
    with mode:
        y = x @ w.t()
        y.backward(g)
    assert mode.gemm_calls >= 3, f"expected forward + 2 gradient GEMMs to be emulated, saw {mode.gemm_calls}"
    assert y.dtype == x.grad.dtype == w.grad.dtype == dt
    xd, wd = x.detach().double(), w.detach().double()
    assert_within_ulp(y, (xd @ wd.t()).to(dt), dt, "mode forward", acc_bound=gemm_bound(xd.abs() @ wd.abs().t(), 96))
    assert_within_ulp(x.grad, (g.double() @ wd).to(dt), dt, "mode dgrad",
                      acc_bound=gemm_bound(g.double().abs() @ wd.abs(), 80))
    assert_within_ulp(w.grad, (g.double().t() @ xd).to(dt), dt, "mode wgrad",
                      acc_bound=gemm_bound(g.double().abs().t() @ xd.abs(), 64))


@pytest.mark.parametrize("dt", DTYPES)
def test_gemm_mode_falls_back_to_fp32_for_missing_cpu_kernels(dt) -> None:
    x = torch.randn(1, 2, 4, 4, 4).to(dt)
    with pytest.raises((NotImplementedError, RuntimeError), match="not implemented for"):
        F.avg_pool3d(x, 2)  # no Half/BFloat16 CPU kernel (NUMERICS §1.4)
    mode = LowPrecisionGemmMode()
    with mode:
        y = F.avg_pool3d(x, 2)
    assert_bitwise_equal(y, F.avg_pool3d(x.float(), 2).to(dt), "avg_pool3d fallback (fp32 compute, one rounding)")
    assert any("avg_pool3d" in op for op in mode.fallback_ops), mode.fallback_ops


@pytest.mark.parametrize("op", ["linear", "conv2d", "sdpa"])
@pytest.mark.parametrize("dt", DTYPES)
def test_autocast_path_and_gemm_mode_path_agree_bitwise(cuda_policy, op, dt) -> None:
    """An fp32 model under emulated autocast and the same model cast to dt under LowPrecisionGemmMode compute
    the same fp32 GEMM on the same rounded inputs: the two emulation paths must agree bit for bit."""
    fn, shapes = {
        "linear": (F.linear, [(64, 96), (80, 96), (80,)]),
        "conv2d": (lambda x, w, b: F.conv2d(x, w, b, padding=1), [(2, 8, 16, 16), (16, 8, 3, 3), (16,)]),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [(2, 4, 32, 16)] * 3),
    }[op]
    inputs = [torch.randn(s) for s in shapes]
    with emulated_autocast(dt):
        via_autocast = fn(*inputs)
    mode = LowPrecisionGemmMode()
    with mode:
        via_mode = fn(*(t.to(dt) for t in inputs))
    assert mode.gemm_calls >= 1
    assert_bitwise_equal(via_autocast, via_mode, f"{op}: autocast path vs LowPrecisionGemmMode path")


# Lower-precision ops that are not one GEMM: CUDA runs the same composite code as CPU, on fp16/bf16 tensors.
COMPOSITES = {
    "einsum(ij,jk->ik)": (lambda a, b: torch.einsum("ij,jk->ik", a, b), [(16, 32), (32, 24)], 32, None),
    "einsum(ij,jk,kl->il)": (lambda a, b, c: torch.einsum("ij,jk,kl->il", a, b, c), [(16, 32), (32, 24), (24, 20)],
                             32 * 24, None),
    "linalg_vecdot": (lambda x, y: torch.linalg.vecdot(x, y), [(64, 256), (64, 256)], 256, None),
    "conv_tbc": (lambda x, w, b: torch.conv_tbc(x, w, b, 1), [(10, 2, 8), (3, 8, 6), (6,)], 3 * 8 + 1, None),
}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.xfail(strict=True, reason=bug)] if bug else [])
                                  for n, (_, _, _, bug) in COMPOSITES.items()])
def test_composite_lower_precision_ops_round_like_cuda(cuda_policy, name, dt) -> None:
    fn, shapes, k, _ = COMPOSITES[name]
    inputs = [torch.randn(s) for s in shapes]
    with emulated_autocast(dt):
        y = fn(*inputs)
    # Reference: the composite itself on the rounded inputs, CPU-native (fp32-accumulating GEMMs/sums, like CUDA).
    ref = fn(*(t.to(dt) for t in inputs))
    bound = gemm_bound(fn(*(t.to(dt).double().abs() for t in inputs)), k)
    assert_within_ulp(y, ref, dt, f"{name} vs its composite run in {dt}", acc_bound=bound)


@pytest.mark.parametrize("module", [
    torch.nn.RNN,
    pytest.param(torch.nn.LSTM, marks=pytest.mark.xfail(strict=True, reason=(
        "CUDA autocast lowers nn.LSTM/nn.GRU through its cuDNN wrapper (aten/src/ATen/cudnn/AutocastRNN.cpp, "
        "_cudnn_rnn_cast_reflatten, registered only in CUDA builds); on CPU they reach mkldnn_rnn_layer / "
        "the GRU decomposition, which the emulation leaves in fp32"))),
    pytest.param(torch.nn.GRU, marks=pytest.mark.xfail(strict=True, reason="as nn.LSTM")),
], ids=lambda m: m.__name__)
def test_rnn_modules_run_in_fp16_like_cudnn_autocast(cuda_policy, module) -> None:
    rnn = module(4, 6)
    with emulated_autocast(FP16):
        out, _ = rnn(torch.randn(5, 3, 4))
    assert out.dtype == FP16, f"nn.{module.__name__} under emulated fp16 autocast gives {out.dtype}; CUDA gives fp16"


# ---------------------------------------------------------------------- 3. dtype policy, op by op


class Inputs:
    """Builds an op's inputs. Floating tensors take their dtypes from ``dtypes`` in turn (cycled), so
    ("low", "fp32") gives mixed inputs for the promote ops. Works on CPU and on fake CUDA (the oracle)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...], low: torch.dtype, device: str = "cpu") -> None:
        self.dtypes, self.low, self.device, self._n = dtypes, low, device, 0

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        dt = self.dtypes[self._n % len(self.dtypes)]
        self._n += 1
        return t.to(dt)

    def x(self, *shape: int) -> torch.Tensor:
        return self._cast(torch.randn(shape, device=self.device))

    def pos(self, *shape: int) -> torch.Tensor:  # for log, rsqrt, ...
        return self._cast(torch.rand(shape, device=self.device) + 0.5)

    def unit(self, *shape: int) -> torch.Tensor:  # inside (-1, 1): acos, asin, erfinv
        return self._cast(torch.rand(shape, device=self.device) * 1.8 - 0.9)

    def prob(self, *shape: int) -> torch.Tensor:
        return self._cast(torch.rand(shape, device=self.device))

    def sign(self, *shape: int) -> torch.Tensor:  # +-1 labels of the embedding/ranking losses
        return self._cast(torch.randint(2, shape, device=self.device) * 2.0 - 1.0)

    def idx(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(high, shape, device=self.device)


def _interp(rank: int, mode: str, **kw: Any) -> Callable[[Inputs], torch.Tensor]:
    return lambda I: F.interpolate(I.x(1, 2, *([4] * rank)), scale_factor=2, mode=mode, **kw)


_A = torch.ops.aten
# One small call per table op that reaches exactly that aten op (checked by recording the AutocastCPU kernels
# that run). Lower-precision ops get fp32 inputs (as a model's); fp32-family ops get low-precision inputs.
RECIPES: dict[str, Callable[[Inputs], Any]] = {
    # lower_precision_fp
    "mm": lambda I: torch.mm(I.x(3, 4), I.x(4, 5)),
    "addmm": lambda I: torch.addmm(I.x(3, 5), I.x(3, 4), I.x(4, 5)),
    "bmm": lambda I: torch.bmm(I.x(2, 3, 4), I.x(2, 4, 5)),
    "baddbmm": lambda I: torch.baddbmm(I.x(2, 3, 5), I.x(2, 3, 4), I.x(2, 4, 5)),
    "addbmm": lambda I: torch.addbmm(I.x(3, 5), I.x(2, 3, 4), I.x(2, 4, 5)),
    "mv": lambda I: torch.mv(I.x(4, 6), I.x(6)),
    "addmv": lambda I: torch.addmv(I.x(4), I.x(4, 6), I.x(6)),
    "addr": lambda I: torch.addr(I.x(4, 5), I.x(4), I.x(5)),
    "matmul": lambda I: torch.matmul(I.x(2, 3, 4), I.x(4, 5)),
    "linear": lambda I: F.linear(I.x(3, 4), I.x(5, 4), I.x(5)),
    "einsum": lambda I: torch.einsum("bij,jk->bik", I.x(2, 3, 4), I.x(4, 5)),
    "linalg_vecdot": lambda I: torch.linalg.vecdot(I.x(4, 6), I.x(4, 6)),
    "chain_matmul": lambda I: torch.chain_matmul(I.x(3, 4), I.x(4, 5), I.x(5, 2)),
    "linalg_multi_dot": lambda I: torch.linalg.multi_dot([I.x(3, 4), I.x(4, 5), I.x(5, 2)]),
    "conv1d": lambda I: F.conv1d(I.x(1, 2, 6), I.x(3, 2, 3), I.x(3)),
    "conv2d": lambda I: F.conv2d(I.x(1, 2, 5, 5), I.x(3, 2, 3, 3), I.x(3)),
    "conv3d": lambda I: F.conv3d(I.x(1, 2, 4, 4, 4), I.x(3, 2, 3, 3, 3), I.x(3)),
    "conv_transpose1d": lambda I: F.conv_transpose1d(I.x(1, 2, 5), I.x(2, 3, 3), I.x(3)),
    "conv_transpose2d.input": lambda I: F.conv_transpose2d(I.x(1, 2, 4, 4), I.x(2, 3, 3, 3), I.x(3)),
    "conv_transpose3d.input": lambda I: F.conv_transpose3d(I.x(1, 2, 3, 3, 3), I.x(2, 3, 2, 2, 2), I.x(3)),
    "conv_tbc": lambda I: torch.conv_tbc(I.x(5, 2, 3), I.x(3, 3, 4), I.x(4), 1),
    "convolution": lambda I: torch.convolution(I.x(1, 2, 5, 5), I.x(3, 2, 3, 3), I.x(3), [1, 1], [0, 0],
                                               [1, 1], False, [0, 0], 1),
    "_convolution": lambda I: _A._convolution.default(I.x(1, 2, 5, 5), I.x(3, 2, 3, 3), I.x(3), [1, 1], [0, 0],
                                                      [1, 1], False, [0, 0], 1, False, False, True, True),
    "_convolution.deprecated": lambda I: _A._convolution.deprecated(I.x(1, 2, 5, 5), I.x(3, 2, 3, 3), I.x(3),
                                                                    [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
                                                                    False, False, True),
    "prelu": lambda I: F.prelu(I.x(2, 3, 4), I.x(3)),
    "scaled_dot_product_attention": lambda I: F.scaled_dot_product_attention(I.x(1, 2, 4, 8), I.x(1, 2, 4, 8),
                                                                             I.x(1, 2, 4, 8)),
    "lstm_cell": lambda I: torch.lstm_cell(I.x(3, 4), [I.x(3, 5), I.x(3, 5)], I.x(20, 4), I.x(20, 5),
                                           I.x(20), I.x(20)),
    "gru_cell": lambda I: torch.gru_cell(I.x(3, 4), I.x(3, 5), I.x(15, 4), I.x(15, 5), I.x(15), I.x(15)),
    "rnn_tanh_cell": lambda I: torch.rnn_tanh_cell(I.x(3, 4), I.x(3, 5), I.x(5, 4), I.x(5, 5), I.x(5), I.x(5)),
    "rnn_relu_cell": lambda I: torch.rnn_relu_cell(I.x(3, 4), I.x(3, 5), I.x(5, 4), I.x(5, 5), I.x(5), I.x(5)),
    # fp32
    **{name: (lambda f: lambda I: f(I.x(4, 6)))(getattr(torch, name))
       for name in ("cosh", "exp", "expm1", "sinh", "tan")},
    **{name: (lambda f: lambda I: f(I.unit(4, 6)))(getattr(torch, name)) for name in ("acos", "asin", "erfinv")},
    **{name: (lambda f: lambda I: f(I.pos(4, 6)))(getattr(torch, name))
       for name in ("log", "log10", "log2", "log1p", "reciprocal", "rsqrt")},
    "pow.Tensor_Scalar": lambda I: torch.pow(I.x(4, 6), 2.0),
    "pow.Tensor_Tensor": lambda I: torch.pow(I.pos(4, 6), I.x(4, 6)),
    "pow.Scalar": lambda I: torch.pow(2.0, I.x(4, 6)),
    "softplus": lambda I: F.softplus(I.x(4, 6)),
    "layer_norm": lambda I: F.layer_norm(I.x(4, 6), (6,), I.x(6), I.x(6)),
    "native_layer_norm": lambda I: torch.native_layer_norm(I.x(4, 6), [6], I.x(6), I.x(6), 1e-5),
    "rms_norm": lambda I: F.rms_norm(I.x(4, 6), (6,), I.x(6)),
    "group_norm": lambda I: F.group_norm(I.x(2, 4, 5), 2, I.x(4), I.x(4)),
    "frobenius_norm.dim": lambda I: _A.frobenius_norm.dim(I.x(4, 6), [1]),
    "nuclear_norm": lambda I: torch.nuclear_norm(I.x(4, 6)),
    "nuclear_norm.dim": lambda I: torch.nuclear_norm(I.x(2, 4, 6), dim=(1, 2)),
    "cosine_similarity": lambda I: F.cosine_similarity(I.x(4, 6), I.x(4, 6)),
    "poisson_nll_loss": lambda I: F.poisson_nll_loss(I.x(4, 6), I.pos(4, 6)),
    "cosine_embedding_loss": lambda I: F.cosine_embedding_loss(I.x(4, 6), I.x(4, 6), I.sign(4)),
    "nll_loss": lambda I: F.nll_loss(I.x(4, 5), I.idx(5, 4)),
    "nll_loss2d": lambda I: F.nll_loss(I.x(2, 3, 4, 4), I.idx(3, 2, 4, 4)),
    "hinge_embedding_loss": lambda I: F.hinge_embedding_loss(I.x(4, 6), I.sign(4, 6)),
    "kl_div": lambda I: F.kl_div(I.x(4, 6), I.prob(4, 6), reduction="batchmean"),
    "l1_loss": lambda I: F.l1_loss(I.x(4, 6), I.x(4, 6)),
    "smooth_l1_loss": lambda I: F.smooth_l1_loss(I.x(4, 6), I.x(4, 6)),
    "huber_loss": lambda I: F.huber_loss(I.x(4, 6), I.x(4, 6)),
    "mse_loss": lambda I: F.mse_loss(I.x(4, 6), I.x(4, 6)),
    "margin_ranking_loss": lambda I: F.margin_ranking_loss(I.x(4), I.x(4), I.sign(4)),
    "multilabel_margin_loss": lambda I: F.multilabel_margin_loss(I.x(2, 3), I.idx(3, 2, 3)),
    "soft_margin_loss": lambda I: F.soft_margin_loss(I.x(4, 6), I.sign(4, 6)),
    "triplet_margin_loss": lambda I: F.triplet_margin_loss(I.x(4, 6), I.x(4, 6), I.x(4, 6)),
    "multi_margin_loss": lambda I: F.multi_margin_loss(I.x(4, 5), I.idx(5, 4)),
    "binary_cross_entropy_with_logits": lambda I: F.binary_cross_entropy_with_logits(I.x(4, 6), I.prob(4, 6)),
    "dist": lambda I: torch.dist(I.x(4, 6), I.x(4, 6)),
    "pdist": lambda I: F.pdist(I.x(4, 6)),
    "cdist": lambda I: torch.cdist(I.x(4, 6), I.x(5, 6)),
    "renorm": lambda I: torch.renorm(I.x(4, 6), 2, 0, 1.0),
    "logsumexp": lambda I: torch.logsumexp(I.x(4, 6), 1),
    "upsample_nearest1d": _interp(1, "nearest"),
    "upsample_nearest2d": _interp(2, "nearest"),
    "upsample_nearest3d": _interp(3, "nearest"),
    "_upsample_nearest_exact1d": _interp(1, "nearest-exact"),
    "_upsample_nearest_exact2d": _interp(2, "nearest-exact"),
    "_upsample_nearest_exact3d": _interp(3, "nearest-exact"),
    "upsample_linear1d": _interp(1, "linear"),
    "upsample_bilinear2d": _interp(2, "bilinear"),
    "_upsample_bilinear2d_aa": _interp(2, "bilinear", antialias=True),
    "upsample_trilinear3d": _interp(3, "trilinear"),
    "upsample_bicubic2d": _interp(2, "bicubic"),
    "_upsample_bicubic2d_aa": _interp(2, "bicubic", antialias=True),
    # fp32_set_opt_dtype
    "softmax.int": lambda I: F.softmax(I.x(4, 6), -1),
    "log_softmax.int": lambda I: F.log_softmax(I.x(4, 6), -1),
    "sum": lambda I: torch.sum(I.x(4, 6)),
    "sum.dim_IntList": lambda I: torch.sum(I.x(4, 6), 1),
    "prod": lambda I: torch.prod(I.x(4, 6)),
    "prod.dim_int": lambda I: torch.prod(I.x(4, 6), 1),
    "cumsum": lambda I: torch.cumsum(I.x(4, 6), 1),
    "cumprod": lambda I: torch.cumprod(I.x(4, 6), 1),
    "linalg_vector_norm": lambda I: torch.linalg.vector_norm(I.x(4, 6)),
    "linalg_matrix_norm": lambda I: torch.linalg.matrix_norm(I.x(4, 6), ord=1),
    "linalg_matrix_norm.str_ord": lambda I: torch.linalg.matrix_norm(I.x(4, 6), ord="fro"),
    # fp32_append_dtype (torch.norm itself now goes to linalg_vector_norm: see EXTRA_CASES)
    "norm.Scalar": lambda I: _A.norm.Scalar(I.x(4, 6), 2),
    "norm.ScalarOpt_dim": lambda I: _A.norm.ScalarOpt_dim(I.x(4, 6), 2, [1]),
    # promote
    "addcmul": lambda I: torch.addcmul(I.x(4), I.x(4), I.x(4)),
    "addcdiv": lambda I: torch.addcdiv(I.x(4), I.x(4), I.pos(4)),
    "atan2": lambda I: torch.atan2(I.x(4), I.x(4)),
    "cross": lambda I: torch.cross(I.x(4, 3), I.x(4, 3), dim=1),
    "dot": lambda I: torch.dot(I.x(5), I.x(5)),
    "vdot": lambda I: torch.vdot(I.x(5), I.x(5)),
    "index_put": lambda I: I.x(5, 3).index_put((I.idx(5, 2),), I.x(2, 3)),
    "scatter_add": lambda I: torch.scatter_add(I.x(4, 5), 0, I.idx(4, 2, 5), I.x(2, 5)),
    "tensordot": lambda I: torch.tensordot(I.x(3, 4), I.x(4, 5), dims=1),
    "bilinear": lambda I: F.bilinear(I.x(3, 4), I.x(3, 5), I.x(6, 4, 5), I.x(6)),
    "grid_sampler": lambda I: F.grid_sample(I.x(1, 2, 4, 4), I.unit(1, 3, 3, 2), align_corners=False),
    # banned
    "binary_cross_entropy": lambda I: F.binary_cross_entropy(I.prob(4, 6), I.prob(4, 6)),
}

NO_RECIPE: dict[str, str] = {
    name: "CUDA-only kernel: it has no CPU implementation, so its emulated dtype cannot be observed on CPU"
    for name in ("_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell",
                 "cudnn_convolution", "cudnn_convolution_transpose")
}

# Ops the brief names explicitly: each must have a recipe.
REQUIRED = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "addr", "matmul", "linear", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "prelu", "einsum",
    "linalg_vecdot", "scaled_dot_product_attention",
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Scalar", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "softplus", "layer_norm",
    "group_norm", "rms_norm", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "binary_cross_entropy_with_logits", "nll_loss", "cdist", "dist", "logsumexp", "upsample_nearest2d",
    "upsample_bilinear2d", "cosine_similarity",
    "softmax.int", "log_softmax.int", "sum", "cumsum", "cumprod", "prod", "linalg_vector_norm",
    "norm.Scalar", "addcmul", "addcdiv", "atan2", "cross", "dot", "vdot", "index_put", "scatter_add",
    "tensordot", "bilinear", "binary_cross_entropy",
}


@dataclass(frozen=True)
class Case:
    id: str
    recipe: Callable[[Inputs], Any]
    inputs: tuple[str, ...]  # dtype roles cycled over the floating inputs: "low", "fp32", "other" (the other low dtype)
    expect: str  # "low" | "fp32" | "raises:<text>"
    reaches: tuple[str, ...] = ()  # table ops whose AutocastCPU kernel must run
    gemm_mode: bool = False  # needs LowPrecisionGemmMode (an op without a Half/BFloat16 CPU kernel)


def _table_cases() -> list[Case]:
    cases = []
    installed = installed_policy()
    for name, recipe in RECIPES.items():
        policy = installed.get(name)
        if policy is None:  # a table op this torch's CUDA autocast does not register (rms_norm before 2.13): left alone
            cases.append(Case(f"{name} (not registered by this torch)", recipe, ("low",), "low"))
        elif policy is CastPolicy.LOWER_PRECISION_FP:
            cases.append(Case(name, recipe, ("fp32",), "low", (name,)))
        elif policy in (CastPolicy.FP32, CastPolicy.FP32_SET_OPT_DTYPE, CastPolicy.FP32_APPEND_DTYPE):
            cases.append(Case(name, recipe, ("low",), "fp32", (name,)))
        elif policy is CastPolicy.PROMOTE:
            cases.append(Case(f"{name}[low+fp32]", recipe, ("low", "fp32"), "fp32", (name,)))
            cases.append(Case(f"{name}[all-low]", recipe, ("low",), "low", (name,)))
        elif policy is CastPolicy.BANNED:
            cases.append(Case(name, recipe, ("fp32",), "raises:unsafe to autocast", (name,)))
        else:
            raise AssertionError(policy)
    return cases


EXTRA_CASES = [
    # unlisted on CUDA: input dtype / native type promotion
    Case("mean (unlisted)", lambda I: torch.mean(I.x(4, 6)), ("low",), "low"),
    Case("gelu (unlisted)", lambda I: F.gelu(I.x(4, 6)), ("low",), "low"),
    Case("relu (unlisted)", lambda I: F.relu(I.x(4, 6)), ("low",), "low"),
    Case("silu (unlisted)", lambda I: F.silu(I.x(4, 6)), ("low",), "low"),
    Case("embedding (unlisted)", lambda I: F.embedding(I.idx(10, 4), I.x(10, 6)), ("fp32",), "fp32"),
    Case("add[low+fp32] (native promotion)", lambda I: I.x(4, 6) + I.x(4, 6), ("low", "fp32"), "fp32"),
    Case("cat[low+fp32] (native promotion)", lambda I: torch.cat([I.x(2, 3), I.x(2, 3)]), ("low", "fp32"), "fp32"),
    Case("stack[low+fp32] (native promotion)", lambda I: torch.stack([I.x(2, 3), I.x(2, 3)]), ("low", "fp32"),
         "fp32"),
    # CPU-only autocast policies that CUDA does not have (removed by the emulation)
    # (torch before 2.13 has no fp16/bf16 trace on a CPU: the audit's LowPrecisionGemmMode computes it in fp32)
    Case("trace (CPU-only fp32)", lambda I: torch.trace(I.x(4, 4)), ("low",), "low", gemm_mode=True),
    Case("avg_pool3d (CPU-only fp32)", lambda I: F.avg_pool3d(I.x(1, 2, 4, 4, 4), 2), ("low",), "low",
         gemm_mode=True),
    Case("conv2d(padding='same')", lambda I: F.conv2d(I.x(1, 2, 5, 5), I.x(3, 2, 3, 3), padding="same"),
         ("fp32",), "low"),
    Case("linear[other-low] (cast to the autocast dtype)", lambda I: F.linear(I.x(3, 4), I.x(5, 4)), ("other",),
         "low", ("linear",)),
    # where CUDA adds the bias in a second kernel, or not (emulation._without_bias;
    # tests/emulation/test_cuda_kernel_models.py)
    Case("linear[non-contiguous 3-D input, bias]", lambda I: F.linear(I.x(3, 2, 4).transpose(0, 1), I.x(5, 4),
                                                                      I.x(5)), ("fp32",), "low", ("linear",)),
    Case("linear[4-D input, 2-D bias]", lambda I: F.linear(I.x(2, 2, 3, 4), I.x(5, 4), I.x(1, 5)), ("fp32",), "low",
         ("linear",)),
    Case("linear[non-contiguous fp64 input, bias] (ineligible)", lambda I: F.linear(
        I.x(3, 2, 4).transpose(0, 1), I.x(5, 4), I.x(5)), ("fp64",), "fp64", ("linear",)),
    Case("conv2d[depthwise, bias]", lambda I: F.conv2d(I.x(1, 4, 5, 5), I.x(8, 1, 3, 3), I.x(8), groups=4),
         ("fp32",), "low", ("conv2d",)),
    Case("_convolution[cudnn disabled, bias]", lambda I: _A._convolution.default(
        I.x(1, 2, 5, 5), I.x(3, 2, 3, 3), I.x(3), [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, False, True),
        ("fp32",), "low", ("_convolution",)),
    Case("exp on fp64 (ineligible)", lambda I: torch.exp(I.x(4, 6)), ("fp64",), "fp64", ("exp",)),
    Case("softmax on fp64 (ineligible)", lambda I: F.softmax(I.x(4, 6), -1), ("fp64",), "fp64", ("softmax.int",)),
    # composites and explicit dtypes
    Case("cross_entropy", lambda I: F.cross_entropy(I.x(4, 5), I.idx(5, 4)), ("low",), "fp32",
         ("log_softmax.int", "nll_loss")),
    Case("torch.norm", lambda I: torch.norm(I.x(4, 6)), ("low",), "fp32", ("linalg_vector_norm",)),
    Case("F.normalize", lambda I: F.normalize(I.x(4, 6)), ("low",), "fp32", ("linalg_vector_norm",)),
    Case("softmax(dtype=low) keeps the caller's dtype", lambda I: F.softmax(I.x(4, 6), -1, dtype=I.low),
         ("low",), "low", ("softmax.int",)),
    Case("sum(dtype=low) keeps the caller's dtype", lambda I: torch.sum(I.x(4, 6), dtype=I.low), ("low",), "low",
         ("sum",)),
    Case("linear on fp64 (ineligible)", lambda I: F.linear(I.x(3, 4), I.x(5, 4)), ("fp64",), "fp64",
         ("linear",)),
    # promote with the other low-precision dtype present (autocast_mode.h `prioritize`)
    Case("addcmul[fp32+other-low]", lambda I: torch.addcmul(I.x(4), I.x(4), I.x(4)), ("fp32", "other"), "fp32",
         ("addcmul",)),
    Case("addcmul[other-low+fp32]", lambda I: torch.addcmul(I.x(4), I.x(4), I.x(4)), ("other", "fp32"),
         "raises:Unexpected floating ScalarType", ("addcmul",)),
]

CASES = _table_cases() + EXTRA_CASES
CASES_BY_ID = {c.id: c for c in CASES}


def _dtypes_for(case: Case, low: torch.dtype) -> tuple[torch.dtype, ...]:
    other = BF16 if low == FP16 else FP16
    roles = {"low": low, "fp32": F32, "other": other, "fp64": torch.float64}
    return tuple(roles[r] for r in case.inputs)


def _expected(case: Case, low: torch.dtype) -> str:
    return {"low": str(low), "fp32": str(F32), "fp64": str(torch.float64)}.get(case.expect, case.expect)


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return next(t for t in out if isinstance(t, torch.Tensor))


def run_case(case: Case, low: torch.dtype, device: str = "cpu") -> str:
    """The output dtype (as str) of a case, or "raises:<message>"."""
    torch.manual_seed(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = case.recipe(Inputs(_dtypes_for(case, low), low, device))
    except Exception as e:  # noqa: BLE001 - the outcome is what is compared
        return f"raises:{type(e).__name__}: {e}"
    return str(_first_tensor(out).dtype)


def _outcome_matches(outcome: str, expected: str) -> bool:
    if expected.startswith("raises:"):
        return outcome.startswith("raises:") and expected.removeprefix("raises:") in outcome
    return outcome == expected


@pytest.fixture
def recorded_policy(monkeypatch):
    """CudaAutocastPolicy whose AutocastCPU kernels record the table op each call reaches."""
    hits: list[str] = []
    make_kernel = emulation._make_kernel

    def recording_make_kernel(op, policy, name):
        kernel = make_kernel(op, policy, name)

        def recorded(*args, **kwargs):
            hits.append(name)
            return kernel(*args, **kwargs)
        return recorded

    monkeypatch.setattr(emulation, "_make_kernel", recording_make_kernel)
    with CudaAutocastPolicy():
        yield hits


def run_emulated(case: Case, low: torch.dtype) -> str:
    mode = LowPrecisionGemmMode() if case.gemm_mode else None
    with emulated_autocast(low, gemm_mode=mode):
        return run_case(case, low)


# Where the emulation is known to disagree with CUDA autocast (bug reports; strict, so a fix shows up).
KNOWN_EMULATION_BUGS: dict[str, str] = {}


def _case_params() -> list:
    params = []
    for case in CASES:
        for dt in (FP16, BF16):
            marks = []
            if case.id in KNOWN_EMULATION_BUGS:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_EMULATION_BUGS[case.id]))
            params.append(pytest.param(case.id, dt, id=f"{case.id}-{DTYPE_NAMES[dt]}", marks=marks))
    return params


CASE_PARAMS = _case_params()


@pytest.mark.parametrize(("case_id", "dt"), CASE_PARAMS)
def test_emulated_dtype_follows_the_cuda_policy(recorded_policy, case_id, dt) -> None:
    case = CASES_BY_ID[case_id]
    outcome = run_emulated(case, dt)
    expected = _expected(case, dt)
    inputs = "/".join(str(d).removeprefix("torch.") for d in _dtypes_for(case, dt))
    policy = installed_policy()[case.reaches[0]].value if case.reaches else "unlisted"
    assert _outcome_matches(outcome, expected), (
        f"{case_id} on {inputs} inputs under emulated {dt} autocast gave {outcome}; CUDA autocast's policy "
        f"({policy}) implies {expected}")
    missing = [op for op in case.reaches if op not in recorded_policy]
    assert not missing, (f"{case_id}: the emulation's AutocastCPU kernel for {missing} never ran (reached: "
                         f"{sorted(set(recorded_policy))}); the recipe does not exercise the table op")


def test_every_table_op_has_a_recipe_or_a_reason() -> None:
    assert set(RECIPES) <= set(CUDA_POLICY), f"recipes for ops not in the table: {set(RECIPES) - set(CUDA_POLICY)}"
    uncovered = set(CUDA_POLICY) - set(RECIPES) - set(NO_RECIPE)
    assert not uncovered, f"table ops with neither a dtype check nor a stated reason: {sorted(uncovered)}"
    assert REQUIRED <= set(RECIPES), f"required ops without a dtype check: {sorted(REQUIRED - set(RECIPES))}"


def test_cpu_autocast_alone_differs_and_is_restored_after_the_policy() -> None:
    low = torch.randn(4, 6).to(FP16)
    w, v = torch.randn(5, 6), torch.randn(6)

    def observe() -> dict[str, torch.dtype]:
        with torch.autocast("cpu", dtype=FP16, cache_enabled=False):
            return {"layer_norm": F.layer_norm(low, (6,)).dtype, "softmax": F.softmax(low, -1).dtype,
                    "exp": torch.exp(low).dtype, "mv": torch.mv(w, v).dtype,
                    "cat": torch.cat([low, w[:4]]).dtype}

    cpu_own = {"layer_norm": FP16, "softmax": FP16, "exp": FP16, "mv": F32, "cat": F32}
    cuda = {"layer_norm": F32, "softmax": F32, "exp": F32, "mv": FP16, "cat": F32}
    assert observe() == cpu_own, "CPU autocast's own lists (NUMERICS §1.3) changed: re-check the emulation"
    with CudaAutocastPolicy():
        assert observe() == cuda, "under CudaAutocastPolicy the CUDA policy must replace CPU autocast's"
    assert observe() == cpu_own, "leaving CudaAutocastPolicy must restore CPU autocast's own kernels"
    with CudaAutocastPolicy():  # re-entering works (the library is destroyed and re-created), so does nesting
        with CudaAutocastPolicy():
            assert observe() == cuda
        assert observe() == cuda, "leaving an inner CudaAutocastPolicy must keep the outer one in force"
    assert observe() == cpu_own


def test_binary_cross_entropy_is_banned_like_cuda(cuda_policy) -> None:
    p, t = torch.rand(4, 6), torch.rand(4, 6)
    with emulated_autocast(FP16), pytest.raises(RuntimeError, match="unsafe to autocast"):
        F.binary_cross_entropy(p, t)
    # outside autocast it is an ordinary op again
    assert F.binary_cross_entropy(p, t).dtype == F32


# ---------------------------------------------------------------- 3b. the fake-CUDA oracle (subprocess)


ORACLE_LIMITATION = "the oracle (real AutocastCUDA kernels on fake CUDA tensors) cannot run this op on a CPU-only build"


def _oracle_main(keys: list[str]) -> None:
    """Subprocess body: for each "case_id|fp16" key print one JSON line with the real AutocastCUDA outcome."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    by_dtype: dict[str, list[str]] = {}
    for key in keys:
        by_dtype.setdefault(key.rsplit("|", 1)[1], []).append(key)
    names = {v: k for k, v in DTYPE_NAMES.items()}
    for dt_name, dt_keys in by_dtype.items():
        low = names[dt_name]
        with FakeTensorMode(allow_non_fake_inputs=True):
            # torch.autocast("cuda") turns itself off without CUDA, so set the flags directly.
            torch.set_autocast_enabled("cuda", True)
            torch.set_autocast_dtype("cuda", low)
            torch.autocast_increment_nesting()
            try:
                for key in dt_keys:
                    print(json.dumps({"begin": key}), flush=True)
                    outcome = run_case(CASES_BY_ID[key.rsplit("|", 1)[0]], low, device="cuda")
                    print(json.dumps({"key": key, "outcome": outcome[:400]}), flush=True)
            finally:
                torch.autocast_decrement_nesting()
                torch.set_autocast_enabled("cuda", False)


def _run_oracle(keys: list[str]) -> dict[str, str]:
    """Runs the oracle in subprocesses; an op that aborts the process is recorded and the rest re-run."""
    results: dict[str, str] = {}
    pending = list(keys)
    repo = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo),
                                                         os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    for _ in range(8):
        if not pending:
            break
        proc = subprocess.run([sys.executable, __file__, "--oracle"], input=json.dumps(pending), env=env,
                              capture_output=True, text=True, timeout=120)
        begun = None
        for line in proc.stdout.splitlines():
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "begin" in msg:
                begun = msg["begin"]
            elif "key" in msg:
                results[msg["key"]] = msg["outcome"]
                begun = None
        if proc.returncode != 0:
            if begun is None:  # died outside any op: give up on the rest
                for key in pending:
                    results.setdefault(key, f"oracle-error:process exited {proc.returncode}: {proc.stderr[-300:]}")
            else:
                results[begun] = f"oracle-error:process aborted ({proc.returncode}): {proc.stderr.strip()[-300:]}"
        pending = [k for k in pending if k not in results]
    for key in pending:
        results[key] = "oracle-error:process kept aborting"
    return results


@pytest.fixture(scope="module")
def oracle() -> dict[str, str]:
    keys = [f"{c.id}|{DTYPE_NAMES[dt]}" for c in CASES for dt in (FP16, BF16)]
    return _run_oracle(keys)


def _oracle_ran(outcome: str) -> bool:
    """Did the oracle decide (a dtype, or an autocast error) rather than fail for lack of a real CUDA?"""
    if outcome.startswith("oracle-error:"):
        return False
    return not outcome.startswith("raises:") or "autocast" in outcome


def test_oracle_runs_and_agrees_with_the_documented_table(oracle) -> None:
    """NUMERICS §1.2 'Observed CUDA-policy results' (found with this oracle), as a check on the oracle itself."""
    observed = {k: v for k, v in oracle.items() if _oracle_ran(v)}
    assert len(observed) >= 0.8 * len(oracle), (
        f"the fake-CUDA oracle ran only {len(observed)}/{len(oracle)} cases; failures: "
        f"{ {k: v for k, v in oracle.items() if not _oracle_ran(v)} }")
    documented = {"linear|fp16": "torch.float16", "matmul|fp16": "torch.float16", "bmm|fp16": "torch.float16",
                  "conv2d|fp16": "torch.float16", "layer_norm|fp16": "torch.float32",
                  "group_norm|fp16": "torch.float32", "softmax.int|fp16": "torch.float32",
                  "cross_entropy|fp16": "torch.float32", "sum|fp16": "torch.float32",
                  "mean (unlisted)|fp16": "torch.float16", "exp|fp16": "torch.float32",
                  "pow.Tensor_Scalar|fp16": "torch.float32", "gelu (unlisted)|fp16": "torch.float16",
                  "silu (unlisted)|fp16": "torch.float16", "embedding (unlisted)|fp16": "torch.float32",
                  "add[low+fp32] (native promotion)|fp16": "torch.float32",
                  "addcmul[low+fp32]|fp16": "torch.float32", "cat[low+fp32] (native promotion)|fp16": "torch.float32"}
    wrong = {k: (oracle[k], v) for k, v in documented.items() if oracle[k] != v}
    assert not wrong, f"oracle disagrees with NUMERICS §1.2 (got, documented): {wrong}"


@pytest.mark.parametrize(("case_id", "dt"), CASE_PARAMS)
def test_emulated_dtype_matches_the_fake_cuda_oracle(oracle, case_id, dt) -> None:
    case = CASES_BY_ID[case_id]
    truth = oracle[f"{case_id}|{DTYPE_NAMES[dt]}"]
    if not _oracle_ran(truth):
        pytest.skip(f"{ORACLE_LIMITATION}: {truth[:200]}")
    with CudaAutocastPolicy():
        outcome = run_emulated(case, dt)
    if truth.startswith("raises:"):
        keyword = "unsafe to autocast" if "unsafe to autocast" in truth else "Unexpected floating ScalarType"
        assert outcome.startswith("raises:") and keyword in outcome, (
            f"{case_id}: CUDA autocast raises ({truth[:120]}...), the emulation gave {outcome[:120]}")
    else:
        assert outcome == truth, f"{case_id} under {dt}: emulation gives {outcome}, real AutocastCUDA gives {truth}"


# ------------------------------------------------------------------- 4. the table vs the installed torch


#: Table ops that torch releases before 2.13 do not register for CUDA autocast (autocast_mode.cpp added them).
ADDED_IN_2_13 = {"rms_norm"}


def test_table_matches_installed_cuda_autocast_registrations() -> None:
    unknown, stale = check_registrations()
    assert unknown == (), (f"torch {torch.__version__} registers CUDA autocast kernels the table lacks (they "
                           f"would be silently mis-emulated): {unknown}")
    allowed = set() if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13) else ADDED_IN_2_13
    assert set(stale) <= allowed, f"table ops torch {torch.__version__} does not register for AutocastCUDA: {stale}"


# What torch 2.11.0+cu130 registers for AutocastCUDA (the first GPU run, 2026-11-27): 2.13's table without rms_norm,
# plus cuDNN's RNN and seven named-tensor overloads.
TORCH_2_11_CUDA_EXTRA = ("_cudnn_rnn", "cumprod.dimname", "cumsum.dimname", "log_softmax.Dimname",
                         "norm.names_ScalarOpt_dim", "prod.dim_Dimname", "softmax.Dimname", "sum.dim_DimnameList")


def test_an_older_cuda_build_gives_no_unknown_ops_and_leaves_the_newer_op_alone() -> None:
    regs = (set(CUDA_POLICY) - ADDED_IN_2_13) | set(TORCH_2_11_CUDA_EXTRA)
    assert check_registrations(regs) == ((), ("rms_norm",))
    assert set(installed_policy(regs)) == set(CUDA_POLICY) - ADDED_IN_2_13
    assert set(TORCH_2_11_CUDA_EXTRA) <= set(UNMODELLED)
    # an op no release is known to register is still reported
    assert check_registrations(regs | {"brand_new_op"})[0] == ("brand_new_op",)


def test_the_emulation_installs_only_what_this_torch_registers(monkeypatch, caplog) -> None:
    """On a torch whose CUDA autocast does not register rms_norm (before 2.13), it stays in its input dtype, as on
    that torch's GPU; cuDNN's RNN and the named-tensor overloads are not warned about as unknown."""
    x, w = torch.randn(4, 6).to(FP16), torch.randn(6).to(FP16)
    with CudaAutocastPolicy(), emulated_autocast(FP16):  # this torch's policy (fp32 from torch 2.13)
        assert F.rms_norm(x, (6,), w).dtype == (F32 if "rms_norm" in registered_cuda_autocast_ops() else FP16)
    older = (registered_cuda_autocast_ops() - ADDED_IN_2_13) | set(TORCH_2_11_CUDA_EXTRA)
    monkeypatch.setattr(emulation, "registered_cuda_autocast_ops", lambda: older)
    with caplog.at_level("WARNING"), CudaAutocastPolicy() as policy, emulated_autocast(FP16):
        assert F.rms_norm(x, (6,), w).dtype == FP16
        assert F.layer_norm(x, (6,), w).dtype == F32  # the others as before
    assert policy.stale_ops == ("rms_norm",) and policy.unknown_ops == ()
    assert "table lacks" not in caplog.text


@pytest.mark.parametrize("name", sorted(CUDA_POLICY))
def test_table_op_resolves(name) -> None:
    op = _resolve(name)
    assert op is not None, f"{name} does not resolve to an aten op overload on torch {torch.__version__}"
    base, _, overload = name.partition(".")
    assert op._schema.name == f"aten::{base}" and op._schema.overload_name == overload, \
        f"{name} resolved to {op._schema.name}.{op._schema.overload_name}"


def test_policy_installs_every_table_op(cuda_policy) -> None:
    assert cuda_policy.skipped == [], f"table ops not re-registered: {cuda_policy.skipped}"
    assert cuda_policy.unknown_ops == ()


def test_fp32_compute_ops_are_lower_precision_table_ops() -> None:
    not_lowered = {n for n in FP32_COMPUTE_OPS if CUDA_POLICY.get(n) is not CastPolicy.LOWER_PRECISION_FP}
    assert not not_lowered, f"FP32_COMPUTE_OPS names that are not lower_precision_fp table ops: {not_lowered}"


if __name__ == "__main__" and "--oracle" in sys.argv:
    _oracle_main(json.loads(sys.stdin.read()))


def test_policies_left_out_of_order_keep_the_innermost_in_force_until_it_leaves() -> None:
    x = torch.randn(4, 6).to(FP16)

    def layer_norm_dtype() -> torch.dtype:
        with torch.autocast("cpu", dtype=FP16, cache_enabled=False):
            return F.layer_norm(x, (6,)).dtype

    outer, inner = CudaAutocastPolicy(), CudaAutocastPolicy()
    outer.__enter__()
    inner.__enter__()
    try:
        assert outer._lib is None and inner._lib is not None  # only the innermost is installed
        outer.__exit__(None, None, None)  # out of order: the inner one stays in force
        assert emulation._ACTIVE == [inner] and layer_norm_dtype() == F32
    finally:
        inner.__exit__(None, None, None)
    assert emulation._ACTIVE == [] and layer_norm_dtype() == FP16  # CPU autocast's own policy is back
