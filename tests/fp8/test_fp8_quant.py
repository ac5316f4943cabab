"""The FP8 / MXFP8 / NVFP4 quantisers (precision_audit/fp8/quant.py): bit-exact against torchao's own reference
quantisers where torchao has them, and against brute force (nearest value of the format's full grid, ties to
even) everywhere, on the hard cases: values at and beyond each format's max, zeros, subnormals, NaN/inf, and
blocks whose amax is 0."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from precision_audit.fp8 import quant as Q

try:
    import torchao  # noqa: F401
    HAVE_TORCHAO = True
except Exception:  # pragma: no cover - the [fp8] extra is absent
    HAVE_TORCHAO = False

needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="torchao is not installed (pip install '.[fp8]')")


def f32(v: float) -> float:
    """Round a Python float to float32 (round to nearest even); beyond float32's range gives inf."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def grid(dtype: torch.dtype) -> list[tuple[float, int]]:
    """Every finite value of an 8-bit float format with its bit pattern (non-negative only)."""
    bits = torch.arange(0, 128, dtype=torch.uint8)
    vals = bits.view(dtype).float().tolist()
    return sorted((v, b) for v, b in zip(vals, range(128)) if math.isfinite(v))


def brute_cast(v: float, dtype: torch.dtype) -> float:
    """Clamp to the format's max, then the nearest grid value; a tie goes to the even bit pattern."""
    if math.isnan(v):
        return math.nan
    m = float(torch.finfo(dtype).max)
    a = min(abs(v), m)
    g = grid(dtype)
    best = min(g, key=lambda t: (abs(t[0] - a), t[1] & 1))
    return math.copysign(best[0], v)


def hard_values(dtype: torch.dtype) -> list[float]:
    fi = torch.finfo(dtype)
    mant = 3 if dtype == Q.E4M3 else 2
    sub = float(fi.smallest_normal) * 2.0 ** -mant
    m = float(fi.max)
    vals = [0.0, -0.0, m, -m, m * 1.01, 464.0, 465.0, 480.0, 1e4, 61439.0, 61440.0, 1e30, sub, sub / 2, sub * 0.51,
            sub * 1.5, float(fi.smallest_normal), float(fi.smallest_normal) * (1 - 2.0 ** -5), 1.0625, 1.125,
            1.1875, 1.25, 1.375, 3.0e-3, -7.7, 0.3]
    g = [v for v, _ in grid(dtype)]
    vals += [(a + b) / 2 for a, b in zip(g, g[1:])]  # every midpoint: every tie of the format
    return vals


@pytest.mark.parametrize("dtype", [Q.E4M3, Q.E5M2])
def test_cast_with_scale_one_matches_brute_force_everywhere(dtype):
    vals = hard_values(dtype)
    x = torch.tensor(vals, dtype=torch.float32)
    q = Q.quantize_with_scale(x, torch.tensor(1.0), dtype)
    got = q.data.float().tolist()
    for v, g in zip(x.tolist(), got):
        want = brute_cast(v, dtype)
        assert g == want or (math.isnan(g) and math.isnan(want)), (v, g, want)
    # saturation: exactly the values the clamp changed (those that would round past max)
    over = Q.elem_overflow_from(dtype)
    assert q.saturated == sum(1 for v in x.tolist() if v != 0 and abs(v) >= over)
    assert q.flushed == sum(1 for v, g in zip(x.tolist(), got) if v != 0 and g == 0)


@pytest.mark.parametrize("dtype", [Q.E4M3, Q.E5M2])
def test_nan_and_inf_inputs(dtype):
    x = torch.tensor([math.nan, math.inf, -math.inf, 1.0])
    q = Q.quantize_with_scale(x, torch.tensor(1.0), dtype)
    d = q.data.float()
    m = float(torch.finfo(dtype).max)
    assert math.isnan(d[0]) and d[1] == m and d[2] == -m and d[3] == 1.0  # clamped before the cast
    assert q.nonfinite == 3 and q.nonzero == 1
    # current scaling of a tensor holding inf: amax inf -> scale 0 -> inf * 0 = NaN (as torchao does)
    t = Q.quantize_tensorwise(torch.tensor([math.inf, 1.0]), dtype)
    assert float(t.scale) == 0.0 and math.isnan(float(t.values[0]))


def test_tensorwise_brute_force_scale_and_values():
    x = torch.tensor([0.0, 1e-6, 3.0, -1000.0, 2.5e-5, 999.0])
    q = Q.quantize_tensorwise(x, Q.E4M3)
    scale = f32(448.0 / 1000.0)  # float64 division, rounded to float32
    assert float(q.scale) == scale
    for v, d, deq in zip(x.tolist(), q.data.float().tolist(), q.values.tolist()):
        want = brute_cast(f32(v * scale), Q.E4M3)
        assert d == want
        assert deq == f32(want / scale)
    assert q.flushed == 2  # 1e-6 and 2.5e-5, times 0.448, are below half of 2^-9 (the smallest subnormal)
    # pow2 rounds the scale down to a power of two
    q2 = Q.quantize_tensorwise(x, Q.E4M3, pow2=True)
    assert float(q2.scale) == 0.25


def test_all_zero_tensor_gives_zeros():
    for q in (Q.quantize_tensorwise(torch.zeros(8), Q.E4M3), Q.quantize_axiswise(torch.zeros(2, 4), Q.E4M3, -1),
              Q.quantize_mx(torch.zeros(2, 64)), Q.quantize_nvfp4(torch.zeros(2, 32))):
        assert torch.equal(q.values, torch.zeros_like(q.values)) and q.flushed == 0 and q.nonzero == 0


def _torchao_dynamic(x, dtype, gran, dim, pow2):
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    g = ScalingGranularity.AXISWISE if gran == "axiswise" else ScalingGranularity.TENSORWISE
    return hp_tensor_to_float8_dynamic(x, dtype, LinearMMConfig(), scaling_granularity=g,
                                       axiswise_dim=dim if gran == "axiswise" else None,
                                       round_scales_to_power_of_2=pow2)


def _hostile(shape=(8, 48), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-8, 3, shape[-1])
    x[0] = 0.0  # a row whose amax is 0
    x[1, 5] = 3e4  # an outlier
    x[2] = torch.randn(shape[-1], generator=g) * 1e-7  # subnormal territory after scaling
    x[3, 0] = 448.0
    return x


@needs_torchao
@pytest.mark.parametrize("dtype", [Q.E4M3, Q.E5M2])
@pytest.mark.parametrize("gran,dim,pow2", [("tensorwise", None, False), ("tensorwise", None, True),
                                           ("axiswise", -1, True), ("axiswise", 0, True), ("axiswise", -1, False)])
def test_float8_matches_torchao_bit_for_bit(dtype, gran, dim, pow2):
    for seed in range(3):
        x = _hostile(seed=seed)
        ref = _torchao_dynamic(x, dtype, gran, dim, pow2)
        q = Q.quantize_tensorwise(x, dtype, pow2) if gran == "tensorwise" else Q.quantize_axiswise(x, dtype, dim, pow2)
        assert torch.equal(q.data.view(torch.uint8), ref._data.view(torch.uint8))
        assert torch.equal(q.scale, ref._scale)
        # torchao's emulated GEMM dequantises as data / scale
        assert torch.equal(q.values, ref._data.float() / ref._scale)


def _mx_cases():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 96, generator=g) * 5
    x[0, :32] = 0.0  # a block whose amax is 0
    x[1, 32:64] = torch.randn(32, generator=g) * 1e-40  # float32 subnormal block
    x[2, 0] = 1e38  # huge
    x[3, 64:96] = 448.0  # exactly the element max
    x[4, 7] = 449.0
    x[5, 40] = math.nan  # a NaN block
    return x


@needs_torchao
@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [Q.E4M3, Q.E5M2])
def test_mx_matches_torchao_to_mx(mode, dtype):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx
    x = _mx_cases()
    q = Q.quantize_mx(x, dtype, 32, -1, mode)
    s, d = to_mx(x, dtype, 32, ScaleCalculationMode.RCEIL if mode == "rceil" else ScaleCalculationMode.FLOOR)
    assert torch.equal(q.block_scale.view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(q.data.view(torch.uint8), d.view(torch.uint8))
    deq = (d.float().reshape(6, 3, 32) * get_fp_scale(s).unsqueeze(-1)).reshape(6, 96)
    assert torch.equal(q.values.nan_to_num(7.0), deq.nan_to_num(7.0))


def test_mx_rceil_brute_force():
    """NVIDIA's rule: the smallest power of two 2^e with amax / 2^e <= 448; nothing saturates."""
    x = _mx_cases()[:5]
    q = Q.quantize_mx(x, Q.E4M3, 32, -1, "rceil")
    for r in range(5):
        for b in range(3):
            blk = x[r, 32 * b:32 * b + 32].tolist()
            amax = max(abs(v) for v in blk)
            e = -127 if amax == 0 else max(-127, min(127, math.ceil(math.log2(f32(amax / 448.0)))))
            got = int(q.block_scale[r, b].view(torch.uint8)) - 127
            if amax > 0:
                assert got == e and amax / 2.0 ** e <= 448.0
            # the biased exponent 0 (2^-127) quantises with a reciprocal of 1, as TE's exp2f_rcp does: such a
            # block (float32 subnormals) flushes to 0
            rcp = 1.0 if e == -127 else 2.0 ** -e
            for v, dq in zip(blk, q.values[r, 32 * b:32 * b + 32].tolist()):
                want = brute_cast(f32(v * rcp), Q.E4M3) * 2.0 ** e if amax > 0 else 0.0
                assert dq == want, (r, b, v, dq, want)
    assert q.saturated == 0


def test_mx_floor_saturates_where_rceil_does_not():
    x = torch.full((1, 32), 1.0)
    x[0, 0] = 511.0  # floor(log2 511) - 8 = 0: 511 > 448 saturates
    assert Q.quantize_mx(x, mode="floor").saturated == 1
    assert Q.quantize_mx(x, mode="rceil").saturated == 0


def test_mx_blocks_run_along_the_chosen_dim_and_pad():
    x = torch.randn(40, 3)
    q = Q.quantize_mx(x, dim=0)  # 40 -> two blocks (32 + 8 padded with zeros) per column
    assert q.block_scale.shape == (3, 2) and q.values.shape == x.shape
    ref = Q.quantize_mx(x.t().contiguous(), dim=-1)
    assert torch.equal(q.values, ref.values.t())


def brute_e2m1(v: float) -> float:
    a = min(abs(v), 6.0)
    grid4 = [(val, i) for i, val in enumerate(Q.E2M1_VALUES)]
    best = min(grid4, key=lambda t: (abs(t[0] - a), t[1] & 1))
    return math.copysign(best[0], v)


def test_e2m1_rounding_brute_force():
    vals = [i / 64 for i in range(0, 64 * 7)] + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 1e-30]
    vals += [-v for v in vals]
    got = Q.round_e2m1(torch.tensor(vals).clamp(-6, 6)).tolist()
    for v, g in zip(vals, got):
        assert g == brute_e2m1(v), (v, g)


@needs_torchao
@pytest.mark.parametrize("two_level", [True, False])
def test_nvfp4_matches_torchao(two_level):
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-6, 2, 64)
    x[0, :16] = 0.0  # block amax 0
    x[1, 16:32] = 1e-9  # block scale below E4M3's tiny: clamped
    x[2, 3] = 1e5
    pts = per_tensor_amax_to_scale(x.abs().max()) if two_level else None
    s_ref, d_ref = nvfp4_quantize(x, 16, pts)
    q = Q.quantize_nvfp4(x, -1, "auto" if two_level else None)
    assert torch.equal(q.block_scale.view(torch.uint8), s_ref.view(torch.uint8).reshape(q.block_scale.shape))
    codes_ref = f4_unpacked_to_f32(unpack_uint4(d_ref).reshape(8, 64))
    assert torch.equal(q.data, codes_ref)
    if two_level:
        assert torch.equal(q.scale, pts)


def test_nvfp4_dequantises_as_code_times_block_times_tensor_scale():
    x = torch.linspace(-3, 3, 32).reshape(1, 32)
    q = Q.quantize_nvfp4(x)
    pts = float(x.abs().max()) / (448 * 6)
    for b in range(2):
        bs = float(q.block_scale[0, b].float())
        for i in range(16):
            k = 16 * b + i
            assert float(q.values[0, k]) == f32(f32(float(q.data[0, k]) * bs) * f32(pts))


def test_delayed_scaling_follows_transformer_engine():
    d = Q.DelayedScaler(Q.E4M3, history_len=1024, margin=0, algo="max")
    q0 = d.quantize(torch.tensor([1000.0, 1.0]))  # step 0: initial scale 1 -> 1000 saturates
    assert float(q0.scale) == 1.0 and q0.saturated == 1 and d.stale_steps == [0]
    assert d.scale == f32(448.0 / 1000.0)
    d.quantize(torch.tensor([10.0]))  # max over the history keeps 1000
    assert d.scale == f32(448.0 / 1000.0)
    d.quantize(torch.tensor([2000.0]))  # beyond the history's amax: saturates with the stale scale
    assert d.stale_steps == [0, 2]
    # most_recent with history 1 (TE's earlier default) follows the last step only
    r = Q.DelayedScaler(Q.E4M3, history_len=1, algo="most_recent")
    for a in (1000.0, 10.0):
        r.quantize(torch.tensor([a]))
    assert r.scale == f32(448.0 / 10.0)
    # margin: amax lands at 2^-margin * fp8_max
    m = Q.DelayedScaler(Q.E4M3, margin=2)
    m.quantize(torch.tensor([448.0]))
    assert m.scale == 0.25
    # an all-zero step keeps the previous scale
    z = Q.DelayedScaler(Q.E5M2, history_len=1)
    z.quantize(torch.tensor([0.0]))
    assert z.scale == 1.0 and z.stale_steps == []
