"""An ``nn.Linear`` emulated under an FP8 / block-scaled recipe: its three GEMMs computed in FP32 from the
dequantised operands (torchao's ``emulate=True``), with what each quantisation did counted (docs/fp8.md)."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..capture.stats import ErrorStats
from ..record.fp8 import Fp8Metrics, Fp8Operand
from . import quant as Q
from .recipes import OPERANDS, Cast, Recipe


@dataclass
class OperandStats:
    """What quantising one operand of one GEMM did, summed over calls. ``scale_min``/``scale_max``: the scales
    chosen (multiply convention, x * scale is stored; for MX the block scale 2^-e, for NVFP4 1 / (block scale x
    tensor scale)), over calls and rows/blocks."""

    saturated: int = 0
    flushed: int = 0
    nonzero: int = 0
    nonfinite: int = 0
    scale_min: float = math.inf
    scale_max: float = -math.inf
    calls: int = 0

    def add(self, q: Q.Quantized, cast: Cast) -> None:
        self.calls += 1
        self.saturated += q.saturated
        self.flushed += q.flushed
        self.nonzero += q.nonzero
        self.nonfinite += q.nonfinite
        s = _effective_scales(q, cast)
        if s.numel():
            fin = s[torch.isfinite(s)]
            if fin.numel():
                self.scale_min = min(self.scale_min, float(fin.min()))
                self.scale_max = max(self.scale_max, float(fin.max()))

    def to_record(self) -> Fp8Operand:
        """audit.json's figures of this operand (``fp8.layers[].recipes[].operands``): shares of the nonzero
        values, the scales None when none was chosen."""
        n = self.nonzero
        return Fp8Operand(saturated_share=self.saturated / n if n else 0.0,
                          flushed_share=self.flushed / n if n else 0.0, saturated=self.saturated,
                          flushed=self.flushed, nonzero=n, nonfinite=self.nonfinite,
                          scale_min=self.scale_min if self.calls and math.isfinite(self.scale_min) else None,
                          scale_max=self.scale_max if self.calls and math.isfinite(self.scale_max) else None)


def _dtype(cast: Cast) -> torch.dtype:
    """The element dtype of an FP8 / MX cast (every one names it: fp8/recipes.py)."""
    if cast.dtype is None:
        raise ValueError(f"a {cast.kind} cast needs an element dtype")
    return cast.dtype


def _effective_scales(q: Q.Quantized, cast: Cast) -> torch.Tensor:
    if cast.kind == "mx":
        assert q.block_scale is not None  # an MX quantisation always has block scales
        e = q.block_scale.view(torch.uint8).float()
        return torch.exp2(Q.E8M0_BIAS - e[e != 255])
    if cast.kind == "nvfp4":
        assert q.block_scale is not None
        outer = q.scale if q.scale is not None else torch.tensor(1.0)
        return 1.0 / (q.block_scale.float().flatten() * outer)
    assert q.scale is not None  # tensorwise, axiswise and delayed casts have one
    return q.scale.flatten().float()


def _dtype_of(cast: Cast) -> torch.dtype:
    if cast.dtype is None:
        raise ValueError(f"a {cast.kind!r} cast names no dtype")
    return cast.dtype


@dataclass
class Fp8State:
    """One module's quantisation state under one recipe: delayed-scaling histories (per tensor role, as
    Transformer Engine keeps one per tensor) and the statistics of every quantisation."""

    recipe: Recipe
    scalers: dict[str, Q.DelayedScaler] = field(default_factory=dict)
    stats: dict[tuple[str, str], OperandStats] = field(default_factory=dict)
    _cache: dict[tuple, Q.Quantized] = field(default_factory=dict)

    def scaler(self, role: str, dtype: torch.dtype) -> Q.DelayedScaler:
        s = self.scalers.get(role)
        if s is None:
            s = self.scalers[role] = Q.DelayedScaler(dtype)
        return s

    def quant(self, gemm: str, role: str, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The operand the GEMM consumes: ``t`` dequantised under the recipe (``t`` itself when the recipe keeps
        this GEMM in high precision)."""
        cast = self.recipe.cast(gemm, role)
        if cast.kind == "hp":
            return t
        q: Q.Quantized | None
        if cast.kind == "tensorwise":
            q = Q.quantize_tensorwise(t, _dtype(cast), cast.pow2)
        elif cast.kind == "axiswise":
            q = Q.quantize_axiswise(t, _dtype(cast), dim, cast.pow2)
        elif cast.kind == "delayed":
            # one quantisation per tensor and call, used by both GEMMs it feeds (TE keeps the FP8 copy)
            key = (role, t.data_ptr(), tuple(t.shape))
            q = self._cache.get(key)
            if q is None:
                q = self._cache[key] = self.scaler(role, _dtype(cast)).quantize(t)
        elif cast.kind == "mx":
            q = Q.quantize_mx(t, _dtype(cast), self.recipe.block, dim)
        elif cast.kind == "nvfp4":
            q = Q.quantize_nvfp4(t, dim)
        else:
            raise ValueError(f"unknown cast kind {cast.kind!r}")
        self.stats.setdefault((gemm, role), OperandStats()).add(q, cast)
        return q.values

    def new_call(self) -> None:
        self._cache.clear()

    def copy(self) -> Fp8State:
        return Fp8State(self.recipe, copy.deepcopy(self.scalers))


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, state: Fp8State):
        state.new_call()
        x2 = x.reshape(-1, x.shape[-1]).float()
        w = weight.float()
        a = state.quant("output", "input", x2, OPERANDS["output"][0][1])
        b = state.quant("output", "weight", w, OPERANDS["output"][1][1])
        out = a @ b.t()
        if bias is not None:
            out = out + bias.float()
        ctx.save_for_backward(x2, w)
        ctx.state, ctx.x_shape, ctx.x_dtype, ctx.has_bias = state, x.shape, x.dtype, bias is not None
        ctx.w_dtype = weight.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x2, w = ctx.saved_tensors
        s: Fp8State = ctx.state
        go = grad_out.reshape(-1, grad_out.shape[-1]).float()
        g1 = s.quant("grad_input", "grad_output", go, OPERANDS["grad_input"][0][1])
        w1 = s.quant("grad_input", "weight", w, OPERANDS["grad_input"][1][1])
        grad_x = (g1 @ w1).reshape(ctx.x_shape).to(ctx.x_dtype)
        g2 = s.quant("grad_weight", "grad_output", go, OPERANDS["grad_weight"][0][1])
        x1 = s.quant("grad_weight", "input", x2, OPERANDS["grad_weight"][1][1])
        grad_w = (g2.t() @ x1).to(ctx.w_dtype)
        grad_b = go.sum(0).to(ctx.w_dtype) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: Fp8State) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its forward and backward GEMMs under ``state.recipe``."""
    return _Fp8LinearFn.apply(x, weight, bias, state)


@contextlib.contextmanager
def patched(modules: dict[torch.nn.Linear, Fp8State]) -> Iterator[None]:
    """Run the given ``nn.Linear`` modules through :func:`fp8_linear` inside the block; their ``forward`` is
    put back on exit (an instance attribute is set and removed; the class is not touched)."""
    saved: list[tuple[torch.nn.Module, object]] = []
    try:
        for m, st in modules.items():
            saved.append((m, m.__dict__.get("forward", _MISSING)))

            def fwd(x, _m=m, _st=st):
                return fp8_linear(x, _m.weight, _m.bias, _st)

            m.forward = fwd  # type: ignore[method-assign]
        yield
    finally:
        for mod, old in saved:
            if old is _MISSING:
                mod.__dict__.pop("forward", None)
            else:
                mod.__dict__["forward"] = old


_MISSING = object()


def metrics_record(e: ErrorStats) -> Fp8Metrics:
    """Error metrics for audit.json's ``fp8`` section: a non-finite figure is None (null in the file) and the
    ``nonfinite`` count beside it says why, as everywhere in audit.json (docs/record.md; it held the strings
    "inf"/"nan" before)."""
    m = e.metrics()

    def finite(k: str) -> float | None:
        v = m[k]
        return v if not isinstance(v, float) or math.isfinite(v) else None

    return Fp8Metrics(rel_l2=finite("rel_l2"), sqnr_db=finite("sqnr_db"), max_abs=finite("max_abs"),
                      cosine=finite("cosine"), nonfinite=int(m["nonfinite"]), elements=int(m["elements"]))
