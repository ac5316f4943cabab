"""CUDA kernels that round more than once, modelled step by step for the emulation (docs/emulation.md, "Kernels:
what CUDA computes, op by op"): the elementwise ``addr`` kernel, the per-batch ``addbmm`` loop, ``conv_tbc``'s
per-tap loop, the fused LSTM/GRU cells (cuda_kernels.py) and cuDNN's convolutions. ``MODELLED_OPS`` maps each
table op to its kernel factory; emulation.py's ``_make_kernel`` uses it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from . import cuda_kernels
from .gemm_mode import LOW_DTYPES, _bound
from .rounding import _AUTOCAST_CPU, _cast_tree, _round_up


def _all_low(dtype: torch.dtype, *tensors: Any) -> bool:
    return all(t is None or (isinstance(t, torch.Tensor) and t.dtype == dtype) for t in tensors) and \
        dtype in LOW_DTYPES


def _gemm_low(fn, dtype: torch.dtype, *tensors: torch.Tensor | None) -> torch.Tensor:
    """A GEMM on low-precision operands as emulated everywhere: fp32 from the rounded values, rounded once."""
    return fn(*(None if t is None else _round_up(t, dtype) for t in tensors)).to(dtype)


def _modelled(body):
    """A kernel for an op whose CUDA kernel is modelled step by step (cuda_kernels.py): the autocast casts, then
    ``body(dtype, *arguments)``, or the native composite when the inputs are not all of the autocast dtype
    (fp64) or the shapes are ones the CUDA kernel rejects."""
    def factory(op: torch._ops.OpOverload, native):
        def kernel(*args, **kwargs):
            dtype = torch.get_autocast_dtype("cpu")
            bound = [_cast_tree(a, dtype) for a in _bound(op, args, kwargs)]
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                out = body(dtype, *bound)
            return native(*args, **kwargs) if out is NotImplemented else out
        return kernel
    return factory


@_modelled
def _addr(dtype, self_, vec1, vec2, beta, alpha):
    if not _all_low(dtype, self_, vec1, vec2) or vec1.dim() != 1 or vec2.dim() != 1:
        return NotImplemented
    return cuda_kernels.AddrFunction.apply(self_, vec1, vec2, beta, alpha)


@_modelled
def _addbmm(dtype, self_, batch1, batch2, beta, alpha):
    if not _all_low(dtype, self_, batch1, batch2) or batch1.dim() != 3 or batch2.dim() != 3:
        return NotImplemented
    return cuda_kernels.AddbmmFunction.apply(self_, batch1, batch2, beta, alpha)


def _cell_ok(dtype, x, h, *rest) -> bool:
    return _all_low(dtype, x, h, *rest) and x.dim() == 2 and h.dim() == 2


@_modelled
def _fused_lstm_cell(dtype, igates, hgates, cx, b_ih, b_hh):
    if not _cell_ok(dtype, igates, hgates, cx, b_ih, b_hh):
        return NotImplemented
    return cuda_kernels.FusedLSTMCellFunction.apply(igates, hgates, cx, b_ih, b_hh)


@_modelled
def _fused_gru_cell(dtype, igates, hgates, hx, b_ih, b_hh):
    if not _cell_ok(dtype, igates, hgates, hx, b_ih, b_hh):
        return NotImplemented
    return cuda_kernels.FusedGRUCellFunction.apply(igates, hgates, hx, b_ih, b_hh)


@_modelled
def _lstm_cell(dtype, x, hx, w_ih, w_hh, b_ih, b_hh):
    # RNN.cpp LSTMCell on CUDA: matmul_ih / matmul_hh (no bias), then _thnn_fused_lstm_cell.
    if len(hx) != 2 or not _cell_ok(dtype, x, hx[0], hx[1], w_ih, w_hh, b_ih, b_hh):
        return NotImplemented
    igates = _gemm_low(torch.mm, dtype, x, w_ih.t())
    hgates = _gemm_low(torch.mm, dtype, hx[0], w_hh.t())
    hy, cy, _ = cuda_kernels.FusedLSTMCellFunction.apply(igates, hgates, hx[1], b_ih, b_hh)
    return hy, cy


@_modelled
def _gru_cell(dtype, x, hx, w_ih, w_hh, b_ih, b_hh):
    # RNN.cpp GRUCell on CUDA: matmul_ih / matmul_hh (no bias), then _thnn_fused_gru_cell.
    if not _cell_ok(dtype, x, hx, w_ih, w_hh, b_ih, b_hh):
        return NotImplemented
    igates = _gemm_low(torch.mm, dtype, x, w_ih.t())
    hgates = _gemm_low(torch.mm, dtype, hx, w_hh.t())
    return cuda_kernels.FusedGRUCellFunction.apply(igates, hgates, hx, b_ih, b_hh)[0]


def _simple_cell(nonlinearity):
    @_modelled
    def cell(dtype, x, hx, w_ih, w_hh, b_ih, b_hh):
        # RNN.cpp SimpleCell: linear_hh(hx).add_(linear_ih(x)), then the nonlinearity, all in the low dtype;
        # each linear is one addmm (bias included, one rounding).
        if not _all_low(dtype, x, hx, w_ih, w_hh, b_ih, b_hh):
            return NotImplemented
        return nonlinearity(_gemm_low(F.linear, dtype, hx, w_hh, b_hh) + _gemm_low(F.linear, dtype, x, w_ih, b_ih))
    return cell


@_modelled
def _conv_tbc(dtype, x, weight, bias, pad):
    if not _all_low(dtype, x, weight, bias) or x.dim() != 3 or weight.dim() != 3:
        return NotImplemented
    return cuda_kernels.ConvTBCFunction.apply(x, weight, bias, int(pad))


def _cudnn_conv(transposed: bool):
    @_modelled
    def conv(dtype, x, w, *params):
        # cudnn_convolution(_transpose) has no CPU kernel: the same convolution, computed in fp32, rounded once.
        if not _all_low(dtype, x, w):
            return NotImplemented
        if transposed:
            padding, output_padding, stride, dilation, groups = params[:5]
        else:
            (padding, stride, dilation, groups), output_padding = params[:4], [0] * (x.dim() - 2)
        return _gemm_low(lambda a, b: torch.convolution(a, b, None, stride, padding, dilation, transposed,
                                                        output_padding, groups), dtype, x, w)
    return conv


MODELLED_OPS = {
    "addr": _addr,
    "addbmm": _addbmm,
    "conv_tbc": _conv_tbc,
    "_thnn_fused_lstm_cell": _fused_lstm_cell,
    "_thnn_fused_gru_cell": _fused_gru_cell,
    "lstm_cell": _lstm_cell,
    "gru_cell": _gru_cell,
    "rnn_tanh_cell": _simple_cell(torch.tanh),
    "rnn_relu_cell": _simple_cell(torch.relu),
    "cudnn_convolution": _cudnn_conv(False),
    "cudnn_convolution_transpose": _cudnn_conv(True),
}
