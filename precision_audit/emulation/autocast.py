"""CUDA autocast numerics on any device (docs/emulation.md).

Two pieces, used together:

- :class:`CudaAutocastPolicy` re-registers the CPU autocast kernels through ``torch.library`` so that
  ``torch.autocast("cpu", dtype)`` decides each op's dtype exactly as CUDA autocast does (layer_norm,
  softmax, sum, exp, ... go to fp32; mv/addmv/addr/einsum go to the low-precision dtype; CPU-only policies
  are removed). The registrations live in a ``torch.library.Library`` that is destroyed on exit, which
  restores torch's own CPU kernels.
- :class:`LowPrecisionGemmMode` (emulation/gemm_mode.py), a ``TorchDispatchMode`` below autograd: GEMM-family
  ops (mm, addmm, bmm, convolution and their backward, CPU flash attention) whose inputs are all fp16 or all bf16
  are computed in fp32 and rounded to that dtype, which is what Tensor Cores do (low-precision inputs, fp32
  accumulation, rounded output) and ~100x faster than CPU-native low-precision GEMMs. Other ops run
  natively in their real dtype, so elementwise rounding is exact; an op with no Half/BFloat16 CPU kernel
  is computed in fp32 and rounded.

Ops whose CUDA kernels round more than once are modelled step by step (modelled_ops.py): the elementwise ``addr``
kernel, the per-batch ``addbmm`` loop, ``conv_tbc``'s per-tap loop, the fused LSTM/GRU cell kernels
(cuda_kernels.py), convolutions whose bias cuDNN leaves to a separate add, and ``linear`` on a non-contiguous input
(matmul, then add). docs/emulation.md lists what each op's CUDA kernel does and what is left (KNOWN_GAPS), which every
emulated audit states.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

import torch

from . import compiled, rounding
from .autocast_policy import CastPolicy, check_registrations, installed_policy, registered_cuda_autocast_ops
from .gemm_mode import _CONV_OPS, LowPrecisionGemmMode, _add_bias, _flat_tensors, _without_bias
from .modelled_ops import MODELLED_OPS
from .rounding import _AUTOCAST_CPU, _cast_tree, _eligible, _round_out, _round_up

log = logging.getLogger(__name__)


KNOWN_GAPS: tuple[str, ...] = (
    "split-K reduced-precision reductions (on by default on CUDA) are not emulated: partial sums are kept in fp32",
    "Tensor Core accumulation order and truncation are modelled as one fp32 sum, rounded once",
    "fp16-accumulation GEMM modes (allow_fp16_accumulation) are not emulated",
    "scaled_dot_product_attention is computed in fp32 and rounded once, forward and backward; FlashAttention "
    "kernels also round the softmax probabilities to fp16/bf16 before multiplying by V",
    "nn.LSTM / nn.GRU: CUDA lowers them to fp16 through cuDNN's own autocast wrapper (_cudnn_rnn_cast_reflatten, "
    "CUDA builds only); the emulation leaves them in fp32",
    "fp32 arithmetic inside kernels follows the CPU: CUDA's expf/tanhf/log and reduction orders differ from the "
    "CPU's in the last fp32 bits, and nvcc fuses a*b+c into FMAs, which can move a rounded fp16/bf16 result "
    "by one ulp",
    "depthwise convolutions are modelled as CUDA's native depthwise kernel (bias added before the one rounding); "
    "fp16 shapes that cuDNN's depthwise heuristic takes round the bias add separately",
    "the backward of addmm/addmv/baddbmm with alpha != 1 multiplies by alpha before rounding (CUDA rounds the "
    "GEMM, then the product)",
    "matmul with a broadcast batch dimension: CUDA rounds the broadcast operand's gradient per batch before "
    "summing it; the emulation sums in fp32 and rounds once",
    "RNN cells on tensors already in fp16/bf16 outside autocast run the CPU composite (rounding every gate "
    "op) instead of CUDA's fused cell kernels",
)

def _resolve(name: str) -> torch._ops.OpOverload | None:
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


def _dtype_arg(op: torch._ops.OpOverload) -> tuple[int | None, bool]:
    for i, a in enumerate(op._schema.arguments):
        if a.name == "dtype":
            return i, a.kwarg_only
    return None, False


# Lower-precision ops that are one GEMM-like computation on Tensor Cores (low-precision inputs, fp32
# accumulation, one rounding of the result). They are computed as fp32(round(inputs)) and rounded once,
# which is exact up to summation order and ~100x faster on a CPU than native fp16/bf16 kernels. Autograd
# sees the casts, so the gradient GEMMs run in fp32 and their results are rounded to the low-precision
# dtype by the casts' backward, just as dgrad/wgrad outputs are on a GPU. Two of them round twice on CUDA in
# some calls, which the kernel models: a convolution whose bias cuDNN leaves to a separate add (_CONV_OPS),
# and linear on a non-contiguous input (matmul, then add).
# Not here, because CUDA runs them as device-agnostic composites that round intermediate results:
# linalg_vecdot ((x * y).sum(-1): every product rounded), chain_matmul / linalg_multi_dot, prelu (its weight
# gradient rounds every product before the sum), and einsum with more than two operands or with a dimension
# summed out of one operand.
# Nor the ops whose CUDA kernels are modelled step by step (modelled_ops.MODELLED_OPS, cuda_kernels.py).
FP32_COMPUTE_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "mv", "addmv", "linear", "matmul", "einsum",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d.input",
    "conv_transpose3d.input", "convolution", "_convolution", "_convolution.deprecated",
    "scaled_dot_product_attention",
})


def _einsum_sums_first(equation: str, n_operands: int) -> bool:
    """Does einsum (Linear.cpp) sum a dimension out of one operand before its pairwise bmm (a rounded sum)?"""
    if n_operands != 2:
        return False
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    ops = lhs.split(",")
    if len(ops) != 2 or not arrow:
        return False  # implicit output keeps every index that appears once
    a, b = (set(o.replace("...", "")) for o in ops)
    out = set(rhs.replace("...", ""))
    if (a - b - out) or (b - a - out):
        return True
    return "..." not in rhs and any("..." in o for o in ops)


def _make_kernel(op: torch._ops.OpOverload, policy: CastPolicy, name: str):
    """The AutocastCPU kernel of one op of CUDA autocast's table: its policy's factory (_KERNEL_FACTORIES)."""
    if policy is CastPolicy.LOWER_PRECISION_FP and name in MODELLED_OPS:
        return MODELLED_OPS[name](op, _make_kernel(op, policy, name + "#native"))
    if policy is CastPolicy.LOWER_PRECISION_FP and name in FP32_COMPUTE_OPS:
        return _fp32_compute_kernel(op, name, _make_kernel(op, policy, name + "#native"))
    factory = _KERNEL_FACTORIES.get(policy)
    if factory is None:
        raise AssertionError(policy)
    return factory(op, name)


def _fp32_compute_kernel(op: torch._ops.OpOverload, name: str, native):
    """One GEMM-like op on Tensor Cores: fp32 from the rounded inputs, rounded once (bias apart where CUDA adds
    it in a second rounding)."""
    separate_bias = name in _CONV_OPS or name == "linear"

    def kernel(*args, **kwargs):
        if name == "einsum" and len(args) > 1 and isinstance(args[1], (list, tuple)) and (
                len(args[1]) > 2 or _einsum_sums_first(args[0], len(args[1]))):
            return native(*args, **kwargs)  # pairwise GEMMs or sums with rounded intermediates
        dtype = torch.get_autocast_dtype("cpu")
        rounded = [_round_up(a, dtype) for a in args]
        if kwargs:
            kwargs = {k: _round_up(v, dtype) for k, v in kwargs.items()}
        bias = None
        if separate_bias:
            rounded, kwargs, bias = _without_bias(op, name, rounded, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            out = _round_out(op(*rounded, **kwargs), dtype)
            if bias is not None:
                out = _add_bias(out, bias, dtype, conv=name != "linear")
            return out
    return kernel


def _lower_precision_kernel(op: torch._ops.OpOverload, name: str):
    # Multi-GEMM chains and elementwise composites (CUDA runs the same composite code): native low
    # precision, with their inner GEMMs emulated.
    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu")
        args, kwargs = _cast_tree(args, dtype), {k: _cast_tree(v, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU), LowPrecisionGemmMode():
            return op(*args, **kwargs)
    return kernel


def _fp32_kernel(op: torch._ops.OpOverload, name: str):
    def kernel(*args, **kwargs):
        args, kwargs = _cast_tree(args, torch.float32), {k: _cast_tree(v, torch.float32) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return op(*args, **kwargs)
    return kernel


def _fp32_set_opt_dtype_kernel(op: torch._ops.OpOverload, name: str):
    idx, kw_only = _dtype_arg(op)

    def kernel(*args, **kwargs):
        if args and _eligible(args[0]) and idx is not None:
            if kw_only or len(args) <= idx:
                if kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif args[idx] is None:
                args = (*args[:idx], torch.float32, *args[idx + 1:])
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return op(*args, **kwargs)
    return kernel


def _fp32_append_dtype_kernel(op: torch._ops.OpOverload, name: str):
    # norm.Scalar -> norm.ScalarOpt_dtype; norm.ScalarOpt_dim -> norm.ScalarOpt_dim_dtype (autocast_mode.cpp).
    target = {"norm.Scalar": torch.ops.aten.norm.ScalarOpt_dtype,
              "norm.ScalarOpt_dim": torch.ops.aten.norm.ScalarOpt_dim_dtype}[name]

    def kernel(*args, **kwargs):
        if not (args and _eligible(args[0])):
            with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
                return op(*args, **kwargs)
        if name == "norm.Scalar":
            p = args[1] if len(args) > 1 else kwargs.get("p", 2)
            call_args: tuple = (args[0], p)
        else:
            call_args = tuple(args) + tuple(kwargs.values())
            if len(call_args) < 4:
                call_args = (*call_args, False)
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            return target(*call_args, dtype=torch.float32)
    return kernel


def _promote_kernel(op: torch._ops.OpOverload, name: str):
    def kernel(*args, **kwargs):
        # at::autocast::prioritize, argument by argument: float32 wins as soon as it is seen (before or
        # after); two lower-precision dtypes must both be the autocast dtype; float64 is ignored.
        lower = torch.get_autocast_dtype("cpu")
        widest = lower
        for t in _flat_tensors((args, kwargs)):
            if not _eligible(t):
                continue
            if widest == torch.float32 or t.dtype == torch.float32:
                widest = torch.float32
            elif not (widest == lower and t.dtype == lower):
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
        args, kwargs = _cast_tree(args, widest), {k: _cast_tree(v, widest) for k, v in kwargs.items()}
        # All in the low dtype, dot/vdot and tensordot's mm are GEMMs: emulated like every other GEMM.
        gemms = LowPrecisionGemmMode() if widest != torch.float32 else contextlib.nullcontext()
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU), gemms:
            return op(*args, **kwargs)
    return kernel


def _banned_kernel(op: torch._ops.OpOverload, name: str):
    def kernel(*args, **kwargs):
        # The message CUDA autocast raises (autocast_mode.cpp, binary_cross_entropy_banned).
        raise RuntimeError(
            "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
            "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
            "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
            "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
            "safe to autocast."
        )
    return kernel


# CastPolicy -> (op, table name) -> AutocastCPU kernel, for every policy but the GEMM-like and modelled ops above.
_KERNEL_FACTORIES = {
    CastPolicy.LOWER_PRECISION_FP: _lower_precision_kernel,
    CastPolicy.FP32: _fp32_kernel,
    CastPolicy.FP32_SET_OPT_DTYPE: _fp32_set_opt_dtype_kernel,
    CastPolicy.FP32_APPEND_DTYPE: _fp32_append_dtype_kernel,
    CastPolicy.PROMOTE: _promote_kernel,
    CastPolicy.BANNED: _banned_kernel,
}


class CudaAutocastPolicy:
    """While active, ``torch.autocast("cpu", dtype)`` follows CUDA autocast's op policies.

    Example::

        with CudaAutocastPolicy(), torch.autocast("cpu", dtype=torch.float16):
            y = torch.nn.functional.layer_norm(x.half(), (64,))   # float32, as on CUDA
    """

    def __init__(self, kernels: str = "python") -> None:
        """``kernels``: ``"python"``, or ``"compiled"`` to use the C++ kernels of :mod:`.compiled` (they must be
        loaded) for the GEMM-family, fp32 and fp32-with-dtype ops; the others stay Python kernels."""
        if kernels not in ("python", "compiled"):
            raise ValueError(f"kernels must be 'python' or 'compiled', not {kernels!r}")
        if kernels == "compiled" and not compiled.is_loaded():
            raise RuntimeError("the compiled kernels are not loaded (precision_audit.emulation.compiled.load())")
        self.kernels = kernels
        self._lib: torch.library.Library | None = None
        self._compiled_on = False
        regs = registered_cuda_autocast_ops()
        self.unknown_ops, self.stale_ops = check_registrations(regs)
        #: the ops this torch's CUDA autocast registers, with their policies: what the emulation installs
        self.policy = installed_policy(regs)
        self.skipped: list[str] = []

    def _compiled_split(self) -> dict[CastPolicy, list[str]]:
        """The ops the compiled kernels take: everything of their three policies except einsum, whose
        3-operand form needs the Python kernel's native path."""
        if self.kernels != "compiled" or rounding._COMPILED_ACTIVE:
            return {}
        split: dict[CastPolicy, list[str]] = {CastPolicy.LOWER_PRECISION_FP: [], CastPolicy.FP32: [],
                                              CastPolicy.FP32_SET_OPT_DTYPE: []}
        for name, policy in self.policy.items():
            if _resolve(name) is None:
                continue
            if policy is CastPolicy.LOWER_PRECISION_FP:
                if name in FP32_COMPUTE_OPS and name != "einsum":
                    split[policy].append(name)
            elif policy in split:
                split[policy].append(name)
        return split

    # Nesting: the inner policy takes the outer one's registrations down while it is active and puts them back when
    # it leaves. (torch 2.13's torch.library lets a second Python kernel override the first for the same op and
    # key; earlier releases refuse it: "already a kernel registered from python".)
    def __enter__(self) -> CudaAutocastPolicy:
        if self.unknown_ops:
            log.warning("CUDA autocast registers ops this emulation's table lacks: %s", ", ".join(self.unknown_ops))
        outer = _ACTIVE[-1] if _ACTIVE else None
        if outer is not None:
            outer._uninstall()
        try:
            self._install()
        except BaseException:
            if outer is not None:
                outer._install()
            raise
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._uninstall()
        finally:  # off the stack whatever happened, so that a failed exit does not leave it in force for good
            if _ACTIVE and _ACTIVE[-1] is self:
                _ACTIVE.pop()
                if _ACTIVE:
                    _ACTIVE[-1]._install()
            elif self in _ACTIVE:  # left out of order: it was not the installed one
                _ACTIVE.remove(self)

    def _install(self) -> None:
        self.skipped = []
        split = self._compiled_split()
        in_cpp = {name for names in split.values() for name in names}
        lib = torch.library.Library("aten", "IMPL")
        self._lib = lib
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for name, policy in self.policy.items():
                    op = _resolve(name)
                    if op is None:
                        self.skipped.append(name)
                        continue
                    if name not in in_cpp:
                        lib.impl(name, _make_kernel(op, policy, name), "AutocastCPU")
                if split:
                    with torch._C._DisableTorchDispatch():
                        compiled.ops().enable(split[CastPolicy.LOWER_PRECISION_FP], split[CastPolicy.FP32],
                                              split[CastPolicy.FP32_SET_OPT_DTYPE])
                    self._compiled_on = rounding._COMPILED_ACTIVE = True
                cuda_names = set(self.policy)
                for reg in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"):
                    name = reg.removeprefix("aten::")
                    if reg.startswith("aten::") and name not in cuda_names:
                        # A CPU-only autocast policy (cat/stack promote, fft in fp32, ...): CUDA has none.
                        lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        if self._compiled_on:
            # what the compiled kernels rounded so far goes into the registry first: once they are off (an inner
            # policy in force, or this one left) nothing drains their records
            rounding._drain_compiled()
            with torch._C._DisableTorchDispatch():
                compiled.ops().disable()
            self._compiled_on = rounding._COMPILED_ACTIVE = False
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None


#: The CudaAutocastPolicy objects entered and not yet left, innermost last (only the last one is installed).
_ACTIVE: list[CudaAutocastPolicy] = []


@contextlib.contextmanager
def emulated_autocast(dtype: torch.dtype, gemm_mode: LowPrecisionGemmMode | None = None) -> Iterator[None]:
    """Forward pass under emulated CUDA autocast; requires an active :class:`CudaAutocastPolicy`.

    ``gemm_mode`` (optional) also catches GEMMs on tensors that are already fp16/bf16 outside autocast's
    reach and ops with no CPU Half/BFloat16 kernel; it costs a Python call per op, so it is used on demand.
    """
    with torch.autocast("cpu", dtype=dtype, cache_enabled=False), (gemm_mode or contextlib.nullcontext()):
        yield
