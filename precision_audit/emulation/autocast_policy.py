"""CUDA autocast's op policies, as emulation needs them.

Source: pytorch/pytorch ``aten/src/ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP``, ``AT_FORALL_FP32``,
``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``) and ``autocast_mode.cpp`` (banned ops, ``rms_norm`` added in
2.13), checked against ``torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")`` on torch 2.13.0
(119 registrations). At start-up :func:`check_registrations` compares this table with the installed torch, so an
op that a newer torch lowers and this table lacks is reported rather than silently mis-emulated.

The emulation installs the table's ops that the installed torch registers (:func:`installed_policy`), so that an
op a newer torch added (``rms_norm``, 2.13) is left alone on an older one, as CUDA autocast there leaves it. Ops it
leaves alone on purpose (cuDNN's RNN, torch 2.11's named-tensor overloads) are in :data:`UNMODELLED`, with why.
"""

from __future__ import annotations

import enum


class CastPolicy(str, enum.Enum):
    LOWER_PRECISION_FP = "lower_precision_fp"  # cast floating inputs to the autocast dtype
    FP32 = "fp32"  # cast floating inputs to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  # pass dtype=float32 unless the caller gave a dtype
    FP32_APPEND_DTYPE = "fp32_append_dtype"  # redispatch to the overload that takes a dtype, with float32
    PROMOTE = "promote"  # run in the widest floating dtype among the inputs
    BANNED = "banned"  # raises under autocast


_LOWER_PRECISION_FP: tuple[str, ...] = (
    "_convolution", "_convolution.deprecated", "_scaled_dot_product_flash_attention", "_thnn_fused_gru_cell",
    "_thnn_fused_lstm_cell", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "conv1d",
    "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input",
    "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "einsum", "gru_cell",
    "linalg_multi_dot", "linalg_vecdot", "linear", "lstm_cell", "matmul", "mm", "mv", "prelu",
    "rnn_relu_cell", "rnn_tanh_cell", "scaled_dot_product_attention",
)

_FP32: tuple[str, ...] = (
    "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "acos", "asin",
    "binary_cross_entropy_with_logits", "cdist", "cosh", "cosine_embedding_loss", "cosine_similarity", "dist",
    "erfinv", "exp", "expm1", "frobenius_norm.dim", "group_norm", "hinge_embedding_loss", "huber_loss",
    "kl_div", "l1_loss", "layer_norm", "log", "log10", "log1p", "log2", "logsumexp", "margin_ranking_loss",
    "mse_loss", "multi_margin_loss", "multilabel_margin_loss", "native_layer_norm", "nll_loss", "nll_loss2d",
    "nuclear_norm", "nuclear_norm.dim", "pdist", "poisson_nll_loss", "pow.Scalar", "pow.Tensor_Scalar",
    "pow.Tensor_Tensor", "reciprocal", "renorm", "rms_norm", "rsqrt", "sinh", "smooth_l1_loss",
    "soft_margin_loss", "softplus", "tan", "triplet_margin_loss", "upsample_bicubic2d", "upsample_bilinear2d",
    "upsample_linear1d", "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
    "upsample_trilinear3d",
)

_FP32_SET_OPT_DTYPE: tuple[str, ...] = (
    "cumprod", "cumsum", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "linalg_vector_norm",
    "log_softmax.int", "prod", "prod.dim_int", "softmax.int", "sum", "sum.dim_IntList",
)

_FP32_APPEND_DTYPE: tuple[str, ...] = (
    "norm.Scalar", "norm.ScalarOpt_dim",
)

_PROMOTE: tuple[str, ...] = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put", "scatter_add",
    "tensordot", "vdot",
)

_BANNED: tuple[str, ...] = (
    "binary_cross_entropy",
)

CUDA_POLICY: dict[str, CastPolicy] = {
    **{name: CastPolicy.LOWER_PRECISION_FP for name in _LOWER_PRECISION_FP},
    **{name: CastPolicy.FP32 for name in _FP32},
    **{name: CastPolicy.FP32_SET_OPT_DTYPE for name in _FP32_SET_OPT_DTYPE},
    **{name: CastPolicy.FP32_APPEND_DTYPE for name in _FP32_APPEND_DTYPE},
    **{name: CastPolicy.PROMOTE for name in _PROMOTE},
    **{name: CastPolicy.BANNED for name in _BANNED},
}

#: Ops CUDA autocast registers that the emulation leaves alone on purpose, each with the reason; they are not
#: reported as unknown (docs/emulation.md, "Known gaps"; a model with an nn.LSTM / nn.GRU gets its own warning).
UNMODELLED: dict[str, str] = {
    "_cudnn_rnn": "nn.LSTM / nn.GRU through cuDNN (CUDA builds only): the emulation leaves them in fp32",
    # torch 2.11's autocast_mode.h lists these fp32_set_opt_dtype / fp32_append_dtype overloads; torch 2.13 removed
    # named tensors. A Python kernel cannot take a named tensor ("Named tensors are currently unsupported in
    # TorchScript"), so the emulation's cannot model them.
    **{name: "a named-tensor overload (torch < 2.13): not emulated" for name in (
        "cumprod.dimname", "cumsum.dimname", "log_softmax.Dimname", "norm.names_ScalarOpt_dim", "prod.dim_Dimname",
        "softmax.Dimname", "sum.dim_DimnameList")},
}


def registered_cuda_autocast_ops() -> set[str]:
    """Op names (``name`` or ``name.overload``) the installed torch registers for CUDA autocast.

    Works on CPU-only builds: the registrations exist whether or not a GPU is present.
    """
    import torch

    regs = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
    return {r.removeprefix("aten::") for r in regs if r.startswith("aten::")}


def installed_policy(regs: set[str] | None = None) -> dict[str, CastPolicy]:
    """The table's policies for the ops the installed torch registers for CUDA autocast (``regs``, by default
    :func:`registered_cuda_autocast_ops`): what the emulation installs, in the table's order."""
    regs = registered_cuda_autocast_ops() if regs is None else regs
    return {name: policy for name, policy in CUDA_POLICY.items() if name in regs}


def check_registrations(regs: set[str] | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(ops the installed torch lowers under CUDA autocast that the table lacks, :data:`UNMODELLED` apart; table ops
    it does not register, which the emulation therefore leaves alone as its CUDA autocast does)."""
    regs = registered_cuda_autocast_ops() if regs is None else regs
    unknown = tuple(sorted(regs - set(CUDA_POLICY) - set(UNMODELLED)))
    stale = tuple(sorted(set(CUDA_POLICY) - regs))
    return unknown, stale
