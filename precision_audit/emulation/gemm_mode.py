"""Tensor Core GEMM numerics below autograd: :class:`LowPrecisionGemmMode`, and the helpers it shares with the
autocast kernels of emulation/autocast.py (where CUDA adds a bias in a second rounding; an op's bound arguments).

GEMM-family ops (mm, addmm, bmm, convolution and their backward, CPU flash attention) whose floating inputs
are all fp16 or all bf16 are computed in fp32 from the rounded values and rounded once, as Tensor Cores do
(docs/emulation.md). An op with no Half/BFloat16 CPU kernel is computed in fp32 and rounded.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from . import cuda_kernels

LOW_DTYPES = (torch.float16, torch.bfloat16)

# Convolution ops with a bias argument. CUDA's _convolution runs cuDNN without the bias and then adds it with
# a separate elementwise kernel (`output.add_(reshape_bias(...))`), so the output is rounded twice; CUDA's own
# depthwise kernels, and the non-cuDNN paths, add the bias inside the kernel (one rounding).
_CONV_OPS = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution", "_convolution", "_convolution.deprecated",
})


def _arg(op: torch._ops.OpOverload, args: list, kwargs: dict, name: str, default: Any = None) -> tuple[int, Any]:
    """(schema index, value) of a named argument, whether passed by position or keyword."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == name:
            if i < len(args):
                return i, args[i]
            if name in kwargs:
                return i, kwargs[name]
            return i, a.default_value if a.has_default_value() else default
    return -1, default


def _cudnn_adds_bias(op: torch._ops.OpOverload, name: str, args: list, kwargs: dict) -> bool:
    """Would CUDA run this convolution through cuDNN, bias added afterwards? (Convolution.cpp select_conv_backend:
    cuDNN unless disabled, or the conv is depthwise, which CUDA's native depthwise kernels take.)"""
    _, enabled = _arg(op, args, kwargs, "cudnn_enabled", None)
    if not (torch.backends.cudnn.enabled if enabled is None else bool(enabled)):
        return False
    _, transposed = _arg(op, args, kwargs, "transposed", name.startswith("conv_transpose"))
    _, groups = _arg(op, args, kwargs, "groups", 1)
    x, w = args[0], args[1]
    depthwise = (not transposed and int(groups) > 1 and x.dim() in (3, 4, 5) and x.shape[1] == int(groups)
                 and w.shape[0] % x.shape[1] == 0)
    return not depthwise


def _linear_adds_bias(x: torch.Tensor, bias: torch.Tensor) -> bool:
    """Does at::linear (Linear.cpp) fall back to matmul + add for this input? Only when the bias cannot be fused
    into addmm: input not 2-D and either not contiguous or a bias that is not (squeezable to) 1-D contiguous."""
    if x.dim() == 2:
        return False
    fusable = (bias.dim() == 1 or bias.squeeze().dim() == 1) and bias.is_contiguous()
    return not (fusable and x.is_contiguous())


def _without_bias(op: torch._ops.OpOverload, name: str, args: list, kwargs: dict):
    """(args, kwargs, bias) with the bias taken out when CUDA adds it in a second rounding, else bias None."""
    idx, bias = _arg(op, args, kwargs, "bias")
    if not isinstance(bias, torch.Tensor) or bias.dtype == torch.float64 or args[0].dtype == torch.float64:
        return args, kwargs, None  # no bias, or fp64 (not autocast's: the op runs as called)
    if name in _CONV_OPS:
        if not _cudnn_adds_bias(op, name, args, kwargs):
            return args, kwargs, None
    elif name != "linear" or not _linear_adds_bias(args[0], bias):
        return args, kwargs, None
    if idx < len(args):
        args = [*args[:idx], None, *args[idx + 1:]]
    else:
        kwargs = {**kwargs, "bias": None}
    return args, kwargs, bias


def _add_bias(out: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype, conv: bool) -> torch.Tensor:
    """The separate bias add, in fp32 from two rounded operands, rounded once more."""
    if conv:
        bias = bias.reshape(1, -1, *([1] * (out.dim() - 2)))
    return (out.float() + bias).to(dtype)

def _bound(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list:
    """All of an op's arguments in schema order, defaults filled in."""
    out = []
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out.append(args[i])
        elif a.name in kwargs:
            out.append(kwargs[a.name])
        else:
            out.append(a.default_value if a.has_default_value() else None)
    return out


def _flat_tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _flat_tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _flat_tensors(v)


_aten = torch.ops.aten

# GEMM-family ops computed in fp32 and rounded when their floating inputs are all fp16 or all bf16.
_GEMM_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten.mv.default, _aten.addmv.default, _aten.dot.default, _aten.vdot.default,
    _aten._addmm_activation.default,
    _aten.convolution.default, _aten.convolution_backward.default,
    _aten._convolution.default,
}
# Their CUDA kernels round more than once: computed by the models of cuda_kernels.py (forward; below autograd,
# their backward formulas run as ordinary ops, GEMMs emulated here).
_MODELLED_FORWARD = {
    _aten.addr.default: cuda_kernels.addr_forward,
    _aten.addbmm.default: cuda_kernels.addbmm_forward,
}
_CONV_MODE_OPS = {_aten.convolution.default: "convolution", _aten._convolution.default: "_convolution"}
# In-place GEMMs (conv_tbc's one addmm_ per kernel tap): computed like their out-of-place forms, then stored.
_INPLACE_GEMM_OPS = {_aten.addmm_.default: _aten.addmm.default, _aten.baddbmm_.default: _aten.baddbmm.default}
# CPU flash attention: (index of the query argument, which outputs stay float32 on the native path).
# Forward returns (out, logsumexp) with logsumexp in fp32; backward takes logsumexp (fp32) as an input.
_SDPA_OPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: (0, (False, True)),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (1, (False, False, False)),
}


def _low_dtype_of(args: Any, kwargs: Any) -> torch.dtype | None:
    dtype = None
    for t in _flat_tensors((args, kwargs)):
        if not t.is_floating_point():
            continue
        if t.dtype not in LOW_DTYPES:
            return None
        if dtype is None:
            dtype = t.dtype
        elif dtype != t.dtype:
            return None
    return dtype


def _up(x: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == dtype else t, x)


class LowPrecisionGemmMode(TorchDispatchMode):
    """Compute fp16/bf16 GEMMs, convolutions and CPU flash attention in fp32, rounding the results.

    Keep it active through ``backward()`` so that the gradient GEMMs are emulated too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gemm_calls = 0
        self.fallback_ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MODELLED_FORWARD:
            dtype = _low_dtype_of(args, kwargs)
            if dtype is not None:
                self.gemm_calls += 1
                return _MODELLED_FORWARD[func](*_bound(func, args, kwargs))
        if func in _INPLACE_GEMM_OPS:
            dtype = _low_dtype_of(args, kwargs)
            if dtype is not None:
                self.gemm_calls += 1
                out = _INPLACE_GEMM_OPS[func](*_up(args, dtype), **_up(kwargs, dtype))
                return args[0].copy_(out.to(dtype))
        if func in _GEMM_OPS:
            dtype = _low_dtype_of(args, kwargs)
            if dtype is not None:
                self.gemm_calls += 1
                if func in _CONV_MODE_OPS:
                    c_args, c_kwargs, bias = _without_bias(func, _CONV_MODE_OPS[func], list(args), kwargs)
                    if bias is not None:
                        out = func(*_up(c_args, dtype), **_up(c_kwargs, dtype)).to(dtype)
                        return _add_bias(out, bias.float(), dtype, conv=True)
                out = func(*_up(args, dtype), **_up(kwargs, dtype))
                return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                                out)
        elif func in _SDPA_OPS:
            q_index, keep32 = _SDPA_OPS[func]
            dtype = args[q_index].dtype
            if dtype in LOW_DTYPES:
                self.gemm_calls += 1
                out = func(*_up(args, dtype), **_up(kwargs, dtype))
                return tuple(t if k32 else t.to(dtype) for t, k32 in zip(out, keep32))
        try:
            return func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as e:
            if not is_missing_low_precision_kernel(e):
                raise
            dtype = torch.float16 if "'Half'" in str(e) else torch.bfloat16
            self.fallback_ops.add(str(func))
            out = func(*_up(args, dtype), **_up(kwargs, dtype))
            return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t,
                            out)


def is_missing_low_precision_kernel(e: BaseException) -> bool:
    """True for the error a CPU kernel without a Half/BFloat16 implementation raises."""
    msg = str(e)
    return isinstance(e, (NotImplementedError, RuntimeError)) and (
        "not implemented for 'Half'" in msg or "not implemented for 'BFloat16'" in msg)


# --- TF32 (docs/emulation.md, "TF32") -----------------------------------------------------------------------------

#: The low mantissa bits TF32 drops from an fp32 value (23 explicit bits -> 10).
TF32_DROPPED_BITS = 13


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to TF32's 10-bit mantissa, round-to-nearest-even, as float32 with the low 13 mantissa
    bits zero. The exponent range stays fp32's: subnormals round on the same grid (kept, not flushed), a value at
    or above (2 - 2^-11) * 2^127 becomes inf, inf and NaN pass unchanged.

    The carry of the rounding runs into the exponent field (1.11...1b rounds up to the next power of two, the
    largest subnormal up to the smallest normal, the largest finite values up to inf), which is what IEEE rounding
    to a narrower mantissa does.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"round_to_tf32 takes float32, not {x.dtype}")
    b = x.contiguous().view(torch.int32)
    lsb = (b >> TF32_DROPPED_BITS) & 1  # the kept mantissa's last bit: a tie goes to the even neighbour
    half = (1 << (TF32_DROPPED_BITS - 1)) - 1  # 0x0FFF: below half rounds down, above it carries
    r = (b + half + lsb) & ~((1 << TF32_DROPPED_BITS) - 1)
    return torch.where(torch.isfinite(x), r.view(torch.float32), x)


# GEMM ops that cuBLAS (allow_tf32 / fp32_precision "tf32") and cuDNN (cudnn.allow_tf32) run on TF32 Tensor Cores
# when their inputs are float32: {op: indices of the arguments that are GEMM operands (rounded)}. An addend
# (addmm's ``self``, a convolution's bias) enters the fp32 epilogue and is not rounded. mv / addmv / dot run as
# cuBLAS gemv / dot, which have no Tensor Core path, so they stay exact fp32.
_TF32_GEMM_OPERANDS: dict[Any, tuple[int, ...]] = {
    _aten.mm.default: (0, 1),
    _aten.bmm.default: (0, 1),
    _aten.addmm.default: (1, 2),
    _aten.baddbmm.default: (1, 2),
    _aten.addbmm.default: (1, 2),
    _aten._addmm_activation.default: (1, 2),
    _aten.addmm_.default: (1, 2),
    _aten.baddbmm_.default: (1, 2),
    _aten.convolution.default: (0, 1),
    _aten._convolution.default: (0, 1),
    # (grad_output, input, weight): the dgrad and wgrad GEMMs read all three
    _aten.convolution_backward.default: (0, 1, 2),
}


def _tf32_operand(t: Any) -> Any:
    return round_to_tf32(t) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t


class Tf32GemmMode(TorchDispatchMode):
    """float32 GEMMs and convolutions as TF32 Tensor Cores compute them: each GEMM operand rounded to TF32
    (:func:`round_to_tf32`), the products accumulated in fp32, the output fp32. Every other op stays fp32.

    Keep it active through ``backward()``: the gradient GEMMs (mm, convolution_backward) run on TF32 too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gemm_calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operands = _TF32_GEMM_OPERANDS.get(func)
        if operands is not None:
            floats = [t for t in _flat_tensors((args, kwargs)) if t.is_floating_point()]
            if floats and all(t.dtype == torch.float32 for t in floats):
                self.gemm_calls += 1
                args = tuple(_tf32_operand(a) if i in operands else a for i, a in enumerate(args))
        return func(*args, **kwargs)


#: What the TF32 emulation leaves out (docs/emulation.md, "TF32"); listed in audit.json's ``emulation.tf32`` when a
#: TF32 pass ran emulated.
TF32_KNOWN_GAPS: tuple[str, ...] = (
    "inputs are rounded to nearest, ties to even (cuBLAS's documented TF32 input conversion); a kernel that feeds "
    "raw fp32 registers to the MMA instruction truncates instead (error up to 2^-10 per operand, not 2^-11)",
    "Tensor Core accumulation order is modelled as one fp32 sum per output (CPU order)",
    "fp32 scaled_dot_product_attention runs as one fused CPU kernel and is not rounded; on CUDA whether it uses "
    "TF32 depends on the attention backend torch picks (the math backend's bmm does)",
    "mv / addmv / dot stay IEEE fp32 (cuBLAS gemv and dot have no Tensor Core path); nn.LSTM / nn.GRU (cuDNN RNN "
    "TF32) are not rounded",
)

#: audit.json's ``emulation.tf32`` for an emulated TF32 pass.
TF32_EMULATION: dict[str, Any] = {
    "rounding": "each GEMM operand rounded to TF32 (10-bit mantissa, round to nearest even, fp32's exponent range), "
                "fp32 accumulation and output; every other op IEEE fp32",
    "gemm_ops": sorted(str(op) for op in _TF32_GEMM_OPERANDS),
    "known_gaps": list(TF32_KNOWN_GAPS),
}
