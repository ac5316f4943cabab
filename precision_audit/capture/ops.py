"""What ran: GEMM-family ops with their shapes, and the bytes every other op moved, per module.

The reference forward records each compute op under the innermost module running it, so an ``x @ w.T``
written inside a forward function is found and attributed like an ``nn.Linear``. A registry maps each
GEMM-family aten op to its GEMM dimensions (M, N, K, batch) and the dimensions a person would pad (in/out
features, channels, head dim). FLOPs come from ``torch.utils.flop_counter`` where it covers the op.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import flop_counter

from .autocast_policy import CUDA_POLICY, CastPolicy

_aten = torch.ops.aten


@dataclass(frozen=True)
class GemmOp:
    """One GEMM-family op as executed: C[batch, M, N] = A[batch, M, K] @ B[batch, K, N]."""

    op: str  # aten op name, e.g. "addmm"
    kind: str  # "matmul" | "conv" | "attention"
    m: int
    n: int
    k: int
    batch: int
    flops: int  # forward FLOPs (2 per multiply-add)
    # dimensions worth padding, by the name a person knows them by: {"K": ("in_features", 1001), ...}
    dims: tuple[tuple[str, str, int], ...]
    note: str | None = None
    # convolutions: the call itself, so that a GPU benchmark times a convolution of this shape (not a matmul)
    conv: ConvSpec | None = None
    # whether CUDA autocast lowers it to fp16/bf16; one it does not (torch._grouped_mm) runs at its inputs' dtype
    # under autocast, and the cost model prices it so (analysis/cost.py)
    lowered: bool = True
    #: bytes of the casts CUDA's fp16/bf16 autocast runs before it (its fp32 operands read, their copies written;
    #: AutocastWidths): the cost model prices them with it, and the cast of their gradients back in its backward
    cast_bytes: int = 0

    def key(self) -> tuple:
        return (self.op, self.kind, self.m, self.n, self.k, self.batch)


def _mm(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    return a.shape[-2], b.shape[-1], a.shape[-1], (a.shape[0] if a.dim() == 3 else 1)


def _gemm_dims(m: int, n: int, k: int) -> tuple[tuple[str, str, int], ...]:
    return (("M", "rows (tokens = batch x sequence for a linear layer)", m),
            ("N", "columns (output features)", n),
            ("K", "reduction (input features)", k))


def _matmul_like(name: str, a_idx: int, b_idx: int) -> Callable[[tuple, dict, Any], GemmOp]:
    def f(args, kwargs, out) -> GemmOp:
        a, b = args[a_idx], args[b_idx]
        m, n, k, batch = _mm(a, b)
        return GemmOp(name, "matmul", m, n, k, batch, 2 * batch * m * n * k, _gemm_dims(m, n, k))
    return f


def _mv(args, kwargs, out) -> GemmOp:
    a = args[0] if args[0].dim() == 2 else args[1]
    m, k = a.shape
    return GemmOp("mv", "matmul", m, 1, k, 1, 2 * m * k, _gemm_dims(m, 1, k))


@dataclass(frozen=True)
class ConvSpec:
    """A convolution call's shapes and arguments (``aten.convolution``'s)."""

    input: tuple[int, ...]
    weight: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int


def _conv(args, kwargs, out) -> GemmOp:
    x, w = args[0], args[1]
    transposed = bool(args[6]) if len(args) > 6 else False
    groups = int(args[8]) if len(args) > 8 else 1
    flops = int(flop_counter.conv_flop_count(list(x.shape), list(w.shape), list(out.shape), transposed=transposed))
    c_in = x.shape[1]
    c_out = w.shape[1] * groups if transposed else w.shape[0]
    spatial = math.prod(out.shape[2:])
    m = out.shape[0] * spatial
    k = (c_in // groups) * math.prod(w.shape[2:])
    note = "grouped/depthwise convolution: maps poorly onto Tensor Cores" if groups > 1 else None
    nd = x.dim() - 2

    def arg(i: int, default: int) -> tuple[int, ...]:
        v = args[i] if len(args) > i else default
        return tuple(int(a) for a in v) if isinstance(v, (list, tuple)) else (int(v),) * nd

    spec = ConvSpec(tuple(x.shape), tuple(w.shape), arg(3, 1), arg(4, 0), arg(5, 1), transposed, arg(7, 0), groups)
    return GemmOp("convolution", "conv", m, c_out, k, 1, flops,
                  (("C_in", "input channels", c_in), ("C_out", "output channels", c_out)), note, spec)


def _conv_tbc(args, kwargs, out) -> GemmOp:
    """conv_tbc: one (time x batch, C_in) @ (C_in, C_out) GEMM per kernel tap (docs/emulation.md)."""
    w = args[1]
    taps, c_in, c_out = w.shape
    m = out.shape[0] * out.shape[1]
    return GemmOp("conv_tbc", "conv", m, c_out, c_in, taps, 2 * taps * m * c_in * c_out,
                  (("C_in", "input channels", c_in), ("C_out", "output channels", c_out)))


def _sdpa_cpu(args, kwargs, out) -> GemmOp:
    q, k_, v = args[0], args[1], args[2]
    flops = int(flop_counter.sdpa_flop_count(list(q.shape), list(k_.shape), list(v.shape)))
    b, h, l, e = q.shape
    s = k_.shape[-2]
    return GemmOp("scaled_dot_product_attention", "attention", l, s, e, b * h, flops,
                  (("E", "head dimension", e),))


_GROUPED_MM_LOWERED = CUDA_POLICY.get("_grouped_mm") is CastPolicy.LOWER_PRECISION_FP


def _grouped_mm(args, kwargs, out) -> GemmOp:
    """torch._grouped_mm: G GEMMs in one kernel (the experts of a mixture of experts; transformers' "grouped_mm"
    experts). Its groups split the rows (2-D x 3-D: out [sum M_g, N]), the columns (3-D x 2-D), the reduction
    (2-D x 2-D: out [G, M, N], sum K_g = K) or nothing (3-D x 3-D: out [G, M, N]). It is in no CUDA autocast list
    of the installed torch's table (capture/autocast_policy.py), so under fp16/bf16 autocast it runs at its
    inputs' dtype."""
    a, b = args[0], args[1]
    k = a.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        groups, m, n = out.shape
        flops, batch, k = 2 * m * n * k, groups, max(1, k // groups)
    else:
        batch = out.shape[0] if out.dim() == 3 else 1
        m, n = out.shape[-2], out.shape[-1]
        flops = 2 * out.numel() * k
    lowered = _GROUPED_MM_LOWERED
    note = None if lowered else (
        "torch._grouped_mm is in no CUDA autocast list: under fp16/bf16 autocast it runs at its inputs' dtype "
        f"({str(a.dtype).removeprefix('torch.')} here), so it gets no fp16/bf16 Tensor Core speed-up")
    return GemmOp("_grouped_mm", "grouped_matmul", m, n, k, batch, flops, _gemm_dims(m, n, k), note,
                  lowered=lowered)


# aten op -> how to read its GEMM dimensions (registering twice is an error, as in flop_counter).
GEMM_REGISTRY: dict[Any, Callable[[tuple, dict, Any], GemmOp]] = {}


def register_gemm(op: Any, fn: Callable[[tuple, dict, Any], GemmOp]) -> None:
    if op in GEMM_REGISTRY:
        raise ValueError(f"{op} is already registered")
    GEMM_REGISTRY[op] = fn


register_gemm(_aten.mm.default, _matmul_like("mm", 0, 1))
register_gemm(_aten.addmm.default, _matmul_like("addmm", 1, 2))
register_gemm(_aten._addmm_activation.default, _matmul_like("addmm", 1, 2))
register_gemm(_aten.bmm.default, _matmul_like("bmm", 0, 1))
register_gemm(_aten.baddbmm.default, _matmul_like("baddbmm", 1, 2))
register_gemm(_aten.addbmm.default, _matmul_like("addbmm", 1, 2))  # one GEMM per batch, summed (docs/emulation.md)
register_gemm(_aten.mv.default, _mv)
register_gemm(_aten.addmv.default, lambda a, kw, o: _mv(a[1:], kw, o))
register_gemm(_aten.convolution.default, _conv)
register_gemm(_aten.conv_tbc.default, _conv_tbc)
register_gemm(_aten._scaled_dot_product_flash_attention_for_cpu.default, _sdpa_cpu)
if hasattr(_aten, "_scaled_dot_product_flash_attention"):
    register_gemm(_aten._scaled_dot_product_flash_attention.default, _sdpa_cpu)
if hasattr(_aten, "_scaled_dot_product_efficient_attention"):
    register_gemm(_aten._scaled_dot_product_efficient_attention.default, _sdpa_cpu)
if hasattr(_aten, "_scaled_dot_product_cudnn_attention"):
    register_gemm(_aten._scaled_dot_product_cudnn_attention.default, _sdpa_cpu)
if hasattr(_aten, "_grouped_mm"):
    register_gemm(_aten._grouped_mm.default, _grouped_mm)
#: GEMM-family ops CUDA autocast does not lower: they run at their inputs' width (AutocastWidths)
_NOT_LOWERED = frozenset([_aten._grouped_mm.default] if hasattr(_aten, "_grouped_mm") and not _GROUPED_MM_LOWERED
                         else [])


@dataclass
class ModuleOps:
    """Ops one module ran itself (not through its children), aggregated over its calls."""

    gemms: dict[tuple, tuple[GemmOp, int]] = field(default_factory=dict)  # key -> (op, count)
    other_elements: int = 0  # elements read + written by its non-GEMM compute ops
    other_ops: int = 0
    #: elements read + written per non-GEMM op -> how many ops moved that many: the cost model prices each op
    #: (each kernel) on its own, with its floor (analysis/cost.py)
    other_sizes: dict[int, int] = field(default_factory=dict)
    #: bytes each non-GEMM op would read + write under CUDA's fp16/bf16 autocast (:class:`AutocastWidths`) -> how
    #: many ops: what the cost model prices a low-precision step's other ops at (empty: not recorded)
    other_low_bytes: dict[int, int] = field(default_factory=dict)

    def add_gemm(self, g: GemmOp) -> None:
        key = g.key()
        old = self.gemms.get(key)
        self.gemms[key] = (g, (old[1] if old else 0) + 1)

    @property
    def gemm_flops(self) -> int:
        return sum(g.flops * c for g, c in self.gemms.values())


def _elements(x: Any) -> int:
    n = 0
    if isinstance(x, torch.Tensor):
        return x.numel() if x.is_floating_point() else 0
    if isinstance(x, (list, tuple)):
        for v in x:
            n += _elements(v)
    return n


def record_op(ops: ModuleOps, func: Any, args: tuple, kwargs: dict, out: Any, low_bytes: int | None = None,
              cast_bytes: int = 0) -> None:
    """Add one executed op to a module's tally; ``low_bytes``: the bytes it would move under fp16/bf16 autocast,
    ``cast_bytes``: the bytes of the casts autocast would add before it (a GEMM's fp32 operands)."""
    reader = GEMM_REGISTRY.get(func)
    if reader is not None:
        try:
            g = reader(args, kwargs, out)
            ops.add_gemm(dataclasses.replace(g, cast_bytes=cast_bytes) if cast_bytes else g)
            return
        except Exception:  # an unusual overload or layout: count its bytes rather than guess its GEMM
            pass
    n = _elements(args) + _elements(out)
    ops.other_ops += 1
    ops.other_elements += n
    ops.other_sizes[n] = ops.other_sizes.get(n, 0) + 1
    if low_bytes is not None:
        ops.other_low_bytes[low_bytes] = ops.other_low_bytes.get(low_bytes, 0) + 1


def _base_name(func: Any) -> str:
    """``aten::native_layer_norm`` -> ``layer_norm``, ``aten::_log_softmax`` -> ``log_softmax``,
    ``aten::nll_loss_forward`` -> ``nll_loss``: the name CUDA autocast's lists give the op it decomposes from."""
    name = str(getattr(func, "_schema", None) and func._schema.name or func).split("::")[-1].split(".")[0]
    name = name.lstrip("_").removeprefix("native_")
    return name.removesuffix("_forward")


#: Ops CUDA autocast runs in fp32 whatever their inputs (its fp32 lists), by base name (:func:`_base_name`).
_AUTOCAST_FP32 = frozenset(k.split(".")[0].lstrip("_") for k, p in CUDA_POLICY.items()
                           if p in (CastPolicy.FP32, CastPolicy.FP32_SET_OPT_DTYPE, CastPolicy.FP32_APPEND_DTYPE))
_LOW_DTYPES = (torch.float16, torch.bfloat16)


class AutocastWidths:
    """The element width (bytes) each floating tensor of the FP32 reference forward would have under CUDA's
    fp16/bf16 autocast, followed op by op: a GEMM autocast lowers writes 2 bytes, an op of its fp32 lists 4, any
    other op the widest of its inputs (0-dim tensors aside, as torch's type promotion), a view or copy its input's,
    and a tensor the forward did not make (parameters, buffers, the batch) its own. :meth:`after` gives the bytes an
    op would read and write there, so that the cost model prices softmax, norms and fp32 residual streams at 4 bytes
    and what follows a GEMM at 2 (analysis/cost.py), rather than each module's ops at its outputs' width."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        self._width: Any = WeakIdKeyDictionary()

    def _of(self, t: torch.Tensor) -> int:
        w = self._width.get(t)
        return int(w) if w is not None else t.element_size()

    def after(self, func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
        """Record the widths of ``func``'s outputs; returns the bytes it would read and write under autocast, and
        those of the casts autocast would add before it (each fp32 operand of a GEMM it lowers: read 4, write 2
        bytes per element)."""
        ins = [t for t in _flat((args, kwargs)) if t.is_floating_point()]
        outs = [t for t in _flat(out) if t.is_floating_point()]
        read = sum(t.numel() * self._of(t) for t in ins)
        dtype = kwargs.get("dtype")
        cast = 0
        if func in GEMM_REGISTRY and (func not in _NOT_LOWERED):
            width = 2
            cast = sum(t.numel() for t in ins if self._of(t) == 4) * 6
            read -= cast // 3  # the GEMM reads the 2-byte copies
        elif isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            width = 2 if dtype in _LOW_DTYPES else dtype.itemsize
        elif _base_name(func) in _AUTOCAST_FP32:
            width = 4
        elif func.is_view or func in (_aten.clone.default, _aten._to_copy.default, _aten.detach.default):
            width = self._of(ins[0]) if ins else 4
        else:
            shaped = [self._of(t) for t in ins if t.dim() > 0] or [self._of(t) for t in ins]
            width = max(shaped, default=4)
        for t in outs:
            self._width[t] = width
        return read + sum(t.numel() for t in outs) * width, cast


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat(v)]
    return []
