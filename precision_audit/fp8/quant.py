"""Exact CPU emulation of the FP8 and block-scaled quantisers (docs/fp8.md, "Quantisers").

Every quantiser scales, clamps to the element format's max, and casts to the real low-precision dtype
(``torch.float8_e4m3fn``, ``torch.float8_e5m2``; FP4 E2M1 values are rounded here and kept as codes, as torch
has no cast to ``float4_e2m1fn_x2``). Dequantisation gives the FP32 operand a GEMM consumes; GEMMs are then
computed in FP32 from the dequantised operands, as torchao's ``emulate=True`` does.

Conventions follow the libraries they model:

- tensorwise and axiswise (rowwise) current scaling: torchao ``float8`` (``amax_to_scale``: the scale is
  ``fp8_max / max(amax, 1e-12)`` computed in float64 then rounded to float32, optionally rounded down to a power
  of two; the data is ``clamp(x * scale)`` cast to FP8; dequantised as ``data / scale``);
- delayed scaling: Transformer Engine's ``DelayedScaling`` (the scale comes from the amax history of *earlier*
  steps: ``scale = fp8_max / amax / 2^margin``, kept unchanged while that amax is 0 or not finite; initial
  scale 1);
- MXFP8: OCP Microscaling v1.0 blocks of 32 along the reduction dimension with one E8M0 (power-of-two) scale;
  the exponent is chosen as NVIDIA's cuBLAS/Transformer Engine do (``rceil``: the smallest power of two with
  ``amax / scale <= elem_max``, so nothing saturates) or as the OCP spec's minimal rule (``floor``);
- NVFP4: E2M1 elements in blocks of 16 with an E4M3 block scale and one FP32 per-tensor scale
  (``amax / (448 * 6)``), as torchao's ``nvfp4_quantize`` computes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}
#: torchao's guard against a zero amax (torchao/float8/float8_utils.py: EPS)
AMAX_EPS = 1e-12
E8M0_BIAS = 127
#: the largest power of two each MX element format holds (OCP MX v1.0 Table 1: emax_elem)
MX_EMAX = {E4M3: 8, E5M2: 15}
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_MAX = float(torch.finfo(E4M3).max)
E4M3_TINY = float(torch.finfo(E4M3).tiny)  # 2^-6: torchao's lower clamp for NVFP4 block scales


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def elem_max(dtype: torch.dtype | str) -> float:
    return E2M1_MAX if dtype == "e2m1" else fp8_max(dtype)  # type: ignore[arg-type]


def elem_overflow_from(dtype: torch.dtype | str) -> float:
    """|x| at and above which a value, before the clamp, would round past the element format's max (so the clamp
    changes it: it *saturates*). Round-to-nearest-even: the midpoint above max rounds up unless max's mantissa
    is even (e4m3fn: 1.110b x 2^8, and e2m1's 6 = 1.1b x 2^2 is odd, e5m2's 1.11b x 2^15 odd)."""
    if dtype == "e2m1":
        return 7.0  # midpoint of 6 and the next exponent's 8: a tie goes to 8 (even), beyond the format
    if dtype == E4M3:
        return float(torch.nextafter(torch.tensor(464.0), torch.tensor(math.inf)))
    if dtype == E5M2:
        return 61440.0
    raise ValueError(f"unknown element dtype {dtype}")


@dataclass
class Quantized:
    """One quantised operand: ``values`` is the dequantised FP32 tensor the GEMM consumes (same shape as the
    input); ``data`` the stored low-precision elements (real FP8 dtype, or FP4 E2M1 values held as float32 for
    NVFP4); ``scale`` the scale(s) in the multiply convention (``data ~= x * scale``) where one applies, and
    ``block_scale`` the stored block scales (E8M0 or E4M3) for block formats."""

    values: torch.Tensor
    data: torch.Tensor
    scale: torch.Tensor | None = None
    block_scale: torch.Tensor | None = None
    saturated: int = 0  # finite non-zero inputs the clamp changed (|x * scale| beyond what rounds to max)
    flushed: int = 0  # finite non-zero inputs that became 0
    nonzero: int = 0  # finite non-zero inputs
    nonfinite: int = 0  # NaN/inf inputs


def _counts(x: torch.Tensor, scaled: torch.Tensor, deq: torch.Tensor, dtype) -> tuple[int, int, int, int]:
    finite = torch.isfinite(x)
    nz = finite & (x != 0)
    sat = nz & (scaled.abs() >= elem_overflow_from(dtype))
    flushed = nz & (deq == 0)
    return int(sat.sum()), int(flushed.sum()), int(nz.sum()), int((~finite).sum())


# -- tensorwise / axiswise (torchao float8) ------------------------------------------------------------------

def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """torchao's ``amax_to_scale``: ``fp8_max / clamp(amax, 1e-12)`` in float64, rounded to float32; ``pow2``
    rounds it down to a power of two (the rowwise recipes)."""
    res = (fp8_max(dtype) / torch.clamp(amax.to(torch.float64), min=AMAX_EPS)).to(torch.float32)
    if pow2:
        res = torch.exp2(torch.floor(torch.log2(res)))
    return res


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Quantized:
    """Scale, clamp to the format's max, cast to ``dtype`` (torchao's ``hp_tensor_and_scale_to_float8``)."""
    scaled = x.to(torch.float32) * scale
    m = fp8_max(dtype)
    data = scaled.clamp(-m, m).to(dtype)
    values = data.float() / scale
    sat, fl, nz, nf = _counts(x, scaled, data.float(), dtype)
    return Quantized(values, data, scale, None, sat, fl, nz, nf)


def quantize_tensorwise(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> Quantized:
    """Current (dynamic) per-tensor scaling from this tensor's own amax."""
    return quantize_with_scale(x, amax_to_scale(x.detach().abs().max(), dtype, pow2), dtype)


def quantize_axiswise(x: torch.Tensor, dtype: torch.dtype, dim: int, pow2: bool = False) -> Quantized:
    """One scale per slice along ``dim`` (the reduction dimension of the GEMM): torchao's AXISWISE granularity,
    ``amax = x.abs().amax(dim, keepdim=True)``. For a 2-D activation and ``dim=-1`` that is one scale per row."""
    return quantize_with_scale(x, amax_to_scale(x.detach().abs().amax(dim=dim, keepdim=True), dtype, pow2), dtype)


# -- delayed scaling (Transformer Engine) --------------------------------------------------------------------

class DelayedScaler:
    """Transformer Engine's delayed scaling for one tensor: the scale used at a step comes from the amax history
    of the steps before it; after the step its own amax is pushed into the history.

    ``algo`` is TE's ``amax_compute_algo``: ``"max"`` (the max over the history; the current default, with
    ``history_len=1024``) or ``"most_recent"`` (the last amax; TE's earlier default with ``history_len=1``).
    """

    def __init__(self, dtype: torch.dtype, history_len: int = 1024, margin: int = 0, algo: str = "max") -> None:
        if algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {algo!r}")
        if history_len < 1:
            raise ValueError("history_len must be >= 1")
        self.dtype, self.history_len, self.margin, self.algo = dtype, history_len, margin, algo
        self.history: list[float] = []
        self.scale = 1.0  # TE initialises the scale to 1
        self.steps = 0
        self.stale_steps: list[int] = []  # steps whose own amax saturated under the scale from history

    def _next_scale(self) -> float:
        if not self.history:
            return self.scale
        amax = max(self.history) if self.algo == "max" else self.history[-1]
        if not (amax > 0) or not math.isfinite(amax):
            return self.scale  # TE: torch.where(amax > 0 and finite, sf, previous scale)
        # TE computes sf = (fp8_max / amax) / 2^margin in FP32
        sf = torch.tensor(fp8_max(self.dtype), dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
        return float(sf / (2.0 ** self.margin))

    def quantize(self, x: torch.Tensor) -> Quantized:
        """Quantise this step's tensor with the scale from history, then record its amax."""
        scale = torch.tensor(self.scale, dtype=torch.float32)
        q = quantize_with_scale(x, scale, self.dtype)
        amax = float(x.detach().abs().max()) if x.numel() else 0.0
        self.observe(amax)
        return q

    def observe(self, amax: float) -> None:
        """Push one step's amax: marks the step stale when that amax exceeds what the scale covered."""
        if math.isfinite(amax) and amax * self.scale >= elem_overflow_from(self.dtype):
            self.stale_steps.append(self.steps)
        self.history = (self.history + [amax])[-self.history_len:]
        self.steps += 1
        self.scale = self._next_scale()


# -- MX block scaling (OCP MX v1.0, NVIDIA) -----------------------------------------------------------------

def _blocks_last(x: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """x with ``dim`` moved last, zero-padded to a multiple of ``block``, shaped (..., nblocks, block)."""
    xt = x.movedim(dim, -1).contiguous()
    shape = tuple(xt.shape)
    k = shape[-1]
    pad = (-k) % block
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    return xt.reshape(*shape[:-1], -1, block), shape, pad


def _unblock(t: torch.Tensor, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    k = shape[-1]
    t = t.reshape(*shape[:-1], -1)[..., :k]
    return t.movedim(-1, dim)


def quantize_mx(x: torch.Tensor, dtype: torch.dtype = E4M3, block: int = 32, dim: int = -1,
                mode: str = "rceil") -> Quantized:
    """MX quantisation along ``dim`` in blocks of ``block`` with E8M0 scales.

    ``mode="rceil"`` (NVIDIA: cuBLAS block quantisation and Transformer Engine): scale exponent
    ``ceil(log2(amax / elem_max))`` clamped to [-127, 127], elements ``x * 2^-e``; ``mode="floor"`` (the OCP
    spec's rule, torchao's default): ``floor(log2(amax)) - emax_elem``, elements ``x / 2^e``. A block whose amax is
    NaN gets the NaN scale (0xFF); an all-zero block keeps zeros (rceil: exponent 0 -> 2^-127).
    """
    xb, shape, _ = _blocks_last(x.to(torch.float32), dim, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    m = fp8_max(dtype)
    if mode == "rceil":
        descale = amax / m
        e = torch.where(torch.isnan(descale), 255,
                        torch.where(torch.isinf(descale), 254,
                                    (torch.clamp(torch.ceil(torch.log2(descale)), -E8M0_BIAS, E8M0_BIAS)
                                     + E8M0_BIAS).to(torch.uint8)))
        e = e.to(torch.uint8)
        rcp = torch.where(e == 255, descale,
                          torch.where(e == 254, torch.tensor(2.0 ** -127),
                                      torch.where(e == 0, torch.tensor(1.0), torch.exp2(E8M0_BIAS - e.float()))))
        scaled = xb * rcp
    elif mode == "floor":
        bits = amax.view(torch.int32)
        unbiased = ((bits >> 23) & 0xFF) - E8M0_BIAS - MX_EMAX[dtype]
        unbiased = torch.clamp(unbiased, -E8M0_BIAS, E8M0_BIAS + 1)
        e = torch.where(torch.isnan(amax), 255, (unbiased + E8M0_BIAS)).to(torch.uint8)
        scale_fp32 = (e.to(torch.int32) << 23).view(torch.float32).clamp(min=2.0 ** -126)
        scaled = xb / scale_fp32
    else:
        raise ValueError(f"mode must be 'rceil' or 'floor', got {mode!r}")
    data = scaled.clamp(-m, m).to(dtype)
    e8m0 = e.view(torch.float8_e8m0fnu)
    # dequantise: element x 2^(e - 127); a NaN scale (0xFF) makes the whole block NaN
    s_fp = torch.where(e == 255, torch.tensor(math.nan), torch.exp2(e.float() - E8M0_BIAS))
    deq = data.float() * s_fp
    values = _unblock(deq, shape, dim)
    sat, fl, nz, nf = _counts(xb, scaled, deq, dtype)
    return Quantized(values, _unblock(data, shape, dim), None, e8m0.squeeze(-1), sat, fl, nz, nf)


# -- NVFP4 (E2M1 elements, E4M3 block scales, FP32 per-tensor scale) -----------------------------------------

def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round FP32 values (already within [-6, 6]) to the nearest E2M1 value, ties to even. E2M1's grid has steps
    of 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; ``torch.round`` rounds half to even, which is the E2M1
    mantissa's evenness at each tie (1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4, 0.25 -> 0, 0.75 -> 1)."""
    a = x.abs()
    r = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    r = torch.where(torch.isnan(a), a, r)
    return torch.copysign(r, x)


def nvfp4_per_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """torchao's ``per_tensor_amax_to_scale``: amax / (448 * 6), in FP32 (dequantisation convention). An all-zero
    tensor gets 1 (torchao would divide by 0; Transformer Engine also falls back to 1 there)."""
    amax = x.detach().abs().max().to(torch.float32) if x.numel() else torch.tensor(0.0)
    s = amax / (E4M3_MAX * E2M1_MAX)
    return torch.where(amax > 0, s, torch.tensor(1.0))


def quantize_nvfp4(x: torch.Tensor, dim: int = -1, per_tensor_scale: torch.Tensor | None | str = "auto",
                   block: int = 16) -> Quantized:
    """NVFP4 along ``dim``: per block ``s = amax / 6 / per_tensor_scale`` cast to E4M3 (clamped to
    [2^-6, 448]); elements ``x * ((1 / per_tensor_scale) / s)`` clamped to [-6, 6] and rounded to E2M1.
    ``per_tensor_scale="auto"`` takes NVIDIA's two-level scaling (amax / (448 * 6)); ``None`` single-level."""
    xf = x.to(torch.float32)
    pts = nvfp4_per_tensor_scale(xf) if isinstance(per_tensor_scale, str) else per_tensor_scale
    xb, shape, _ = _blocks_last(xf, dim, block)
    amax = xb.abs().amax(dim=-1)
    bs = amax / E2M1_MAX
    if pts is None:
        bs8 = torch.clamp(bs, min=E4M3_TINY, max=E4M3_MAX).to(E4M3)
        bs32 = bs8.float()
        rcp = 1.0 / bs32
        outer = torch.tensor(1.0)
    else:
        bs8 = torch.clamp(bs / pts, min=E4M3_TINY, max=E4M3_MAX).to(E4M3)
        bs32 = bs8.float()
        rcp = (1.0 / pts) / bs32
        outer = pts
    scaled = xb * rcp.unsqueeze(-1)
    codes = round_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX))
    deq = codes * bs32.unsqueeze(-1) * outer
    values = _unblock(deq, shape, dim)
    sat, fl, nz, nf = _counts(xb, scaled, deq, "e2m1")
    scale = pts if isinstance(pts, torch.Tensor) else None
    return Quantized(values, _unblock(codes, shape, dim), scale, bs8, sat, fl, nz, nf)
