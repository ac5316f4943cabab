"""PyTorch's own CUDA autocast test lists, run through the emulation on CPU (docs/emulation.md).

``torch.testing._internal.autocast_test_lists.AutocastTestLists`` is what torch's test_cuda.py checks CUDA autocast
with. It is built here on CPU tensors and every entry runs under ``CudaAutocastPolicy`` + ``emulated_autocast``,
the way torch's harness (``TestAutocast._run_autocast_outofplace``) runs it on a GPU: the ``torch.*``/module
variant and the ``Tensor.*`` variant, each output's dtype checked against the list's. Values are then checked
against models of the CUDA kernels, with zero mismatches allowed:

- lower-precision ops: inputs rounded to fp16/bf16, GEMMs accumulated in fp32 (torch's CPU fp32 kernels fix one
  summation order; ``test_gemm_models_are_within_fp32_accumulation_of_float64`` checks they are within the fp32
  accumulation bound of a float64 brute force) and rounded once, plus each kernel's own extra roundings: cuDNN
  adding a convolution's bias in a second kernel, addr's elementwise arithmetic, addbmm's per-batch rounding,
  the fused LSTM/GRU cell kernels (the element-by-element models of tests/emulation/test_cuda_kernel_models.py),
  conv_tbc's
  rounded add per kernel tap, the chained GEMMs of chain_matmul/multi_dot, vecdot's rounded products;
- fp32 and promote ops: the op computed in fp32 (CUDA's fp32 kernels differ from the CPU's only in the last fp32
  bits, a documented gap);
- the builtin-promotion ops: the op itself, outside autocast.

Every entry whose op has a backward is also run backward: gradient dtypes as autocast leaves them, values within
a few low-precision ulps of float64 autograd on the rounded inputs (the exact backward models are in
tests/emulation/test_cuda_kernel_models.py).

A torch upgrade that adds, removes or changes an entry changes what runs here: the set of ops is pinned below.
"""

from __future__ import annotations

import collections.abc
import importlib.util
import sys
import types
import unittest
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from precision_audit.emulation.autocast import CudaAutocastPolicy, emulated_autocast
from precision_audit.emulation.autocast_policy import registered_cuda_autocast_ops
from test_cuda_kernel_models import addr_model, as_list, gru_model, lstm_model, tensor
from test_emulation import ADDED_IN_2_13

FP16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# the lists call chain_matmul and cross without dim, both deprecated
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated:UserWarning")


def load_lists() -> type:
    """``AutocastTestLists`` from the installed torch's own file. Its module imports torch's test utilities only
    for ``TEST_WITH_ROCM`` and ``TestCase``; importing those for real needs ``expecttest`` and switches torch's
    global backend flags off, so the two names come from a stand-in module instead."""
    spec = importlib.util.find_spec("torch.testing._internal.autocast_test_lists")
    assert spec is not None and spec.origin, "torch.testing._internal.autocast_test_lists is missing"
    source = Path(spec.origin).read_text()
    name = "torch.testing._internal.common_utils"
    shim = types.ModuleType(name)
    shim.TEST_WITH_ROCM = False
    shim.TestCase = unittest.TestCase
    saved = sys.modules.get(name)
    sys.modules[name] = shim
    try:
        namespace: dict[str, Any] = {"__name__": "autocast_test_lists_cpu"}
        exec(compile(source, spec.origin, "exec"), namespace)
    finally:
        if saved is None:
            del sys.modules[name]
        else:
            sys.modules[name] = saved
    return namespace["AutocastTestLists"]


# list name -> (module whose function is tried first, dtype the ops run in: "low" or a dtype)
LISTS = {
    "torch_expect_builtin_promote": (torch, F32),
    "methods_expect_builtin_promote": (None, F32),
    "torch_fp16": (torch, "low"),
    "torch_fp32": (torch, F32),
    "torch_need_autocast_promote": (torch, F32),
    "nn_fp16": (torch._C._nn, "low"),
    "nn_fp32": (torch._C._nn, F32),
    "linalg_fp16": (torch._C._linalg, "low"),
    "methods_fp16": (None, "low"),
    "methods_fp32": (None, F32),
    "banned": (None, None),
}
# The lower-precision lists are also run under bf16 autocast (their inputs are fp32); the others hold fp16 inputs.
BF16_LISTS = ("torch_fp16", "nn_fp16", "linalg_fp16", "methods_fp16")

# What torch 2.13's lists hold (op names per list). A torch that changes them fails here first: re-check the
# emulation's table and models for the new entries, then update this.
EXPECTED_OPS = {
    "torch_expect_builtin_promote": {"eq", "ge", "gt", "le", "lt", "ne", "add", "div", "mul", "cat", "equal", "stack"},
    "methods_expect_builtin_promote": {"__eq__", "__ge__", "__gt__", "__le__", "__lt__", "__ne__", "__add__",
                                       "__div__", "__mul__"},
    "torch_fp16": {"_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
                   "conv_transpose3d", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "prelu",
                   "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "chain_matmul", "addbmm", "baddbmm",
                   "bmm", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"},
    "torch_fp32": {"acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
                   "rsqrt", "sinh", "tan", "pow", "softmax", "log_softmax", "layer_norm", "rms_norm", "group_norm",
                   "norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss",
                   "kl_div", "margin_ranking_loss", "triplet_margin_loss", "binary_cross_entropy_with_logits",
                   "cumprod", "cumsum", "dist", "pdist", "cdist", "prod", "renorm", "sum", "logsumexp"},
    "torch_need_autocast_promote": {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot",
                                    "grid_sampler", "index_put", "tensordot", "scatter_add"},
    "nn_fp16": {"linear"},
    "nn_fp32": {"softplus", "nll_loss", "nll_loss2d", "l1_loss", "smooth_l1_loss", "mse_loss",
                "multilabel_margin_loss", "soft_margin_loss", "multi_margin_loss"},
    "linalg_fp16": {"linalg_vecdot", "linalg_multi_dot"},
    "methods_fp16": {"__matmul__"},
    "methods_fp32": {"__pow__"},
    "banned": {"binary_cross_entropy"},
}
# torch's own harness (test_cuda.py) reads a torch_fp16 entry's third element as "skip": the einsum entry puts its
# tensors there (its second element is the equation), so torch itself never runs it; neither do we.
SKIPPED_BY_TORCH = {"einsum"}


@pytest.fixture(scope="module", autouse=True)
def cuda_policy():
    """One CudaAutocastPolicy for the module (it changes nothing outside emulated_autocast)."""
    with CudaAutocastPolicy():
        yield


@pytest.fixture(scope="module")
def lists():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_lists()("cpu")


class Entry:
    """One list entry, as torch's harness reads it."""

    def __init__(self, list_name: str, index: int, raw: tuple) -> None:
        self.list_name, self.index, self.op = list_name, index, raw[0]
        self.module, self.run_as = LISTS[list_name]
        self.kwargs: dict = {}
        self.out_type = None
        self.skip = False
        if list_name.endswith("builtin_promote"):
            self.args, self.out_type = raw[1], raw[2]
        elif list_name == "banned":
            self.args, self.module = raw[1], raw[2]
        else:
            self.args = raw[1]
            if len(raw) > 2:
                if list_name == "torch_fp16":
                    self.skip = bool(raw[2]) if not isinstance(raw[2], tuple) else True
                else:
                    self.kwargs = raw[2]
        self.id = f"{list_name}[{index}]:{self.op}"


def entries(lists_obj) -> list[Entry]:
    out = []
    for name in LISTS:
        for i, raw in enumerate(getattr(lists_obj, name)):
            out.append(Entry(name, i, raw))
    return out


def _entry_params() -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        all_entries = entries(load_lists()("cpu"))
    params = []
    for e in all_entries:
        if e.skip:
            continue
        params.append(pytest.param(e.list_name, e.index, FP16, id=f"{e.id}-fp16"))
        if e.list_name in BF16_LISTS:
            params.append(pytest.param(e.list_name, e.index, BF16, id=f"{e.id}-bf16"))
    return params


ENTRY_PARAMS = _entry_params()


def _entry(lists_obj, list_name: str, index: int) -> Entry:
    return Entry(list_name, index, getattr(lists_obj, list_name)[index])


def _variants(e: Entry) -> list[tuple[str, Any]]:
    """The calls torch's harness makes: module.op and Tensor.op, whichever exist."""
    calls = []
    if e.module is not None and hasattr(e.module, e.op):
        calls.append(("module", lambda args, kw: getattr(e.module, e.op)(*args, **kw)))
    if hasattr(torch.Tensor, e.op):
        calls.append(("method", lambda args, kw: getattr(args[0], e.op)(*args[1:], **kw)))
    return calls


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _map(x: Any, fn) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    return x


def run_emulated(e: Entry, low: torch.dtype, call) -> Any:
    with emulated_autocast(low):
        return call(e.args, e.kwargs)


# ------------------------------------------------------------------------------- CUDA-kernel models


def _r(t: Any, low: torch.dtype) -> Any:
    """The autocast cast: floating tensors (not fp64) to ``low``, held as fp32 for the fp32 GEMM models."""
    return _map(t, lambda v: v.to(low).float() if v.is_floating_point() and v.dtype != F64 else v)


def _cudnn_bias(y32: torch.Tensor, bias: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """cuDNN's convolution (rounded), then _convolution's `output.add_(bias)` (rounded again)."""
    return (y32.to(low).float() + bias.to(low).float().reshape(1, -1, *([1] * (y32.dim() - 2)))).to(low)


def _conv_tbc(x, w, b, pad: int, low):
    """ConvolutionTBC.cpp: output = bias; for each kernel tap one addmm_ into the low-precision output."""
    x, w = _r(x, low), _r(w, low)
    ilen, batch, _ = x.shape
    kw = w.shape[0]
    olen = ilen - kw + 1 + 2 * pad
    out = b.to(low).expand(olen, batch, w.shape[2]).clone()
    for k in range(kw):
        i_shift, o_shift = max(0, k - pad), max(0, pad - k)
        t = min(ilen + pad - k, olen) - o_shift
        if t > 0:
            inp = x[i_shift:i_shift + t].reshape(t * batch, -1)
            o = out[o_shift:o_shift + t].reshape(t * batch, -1)
            o.copy_((torch.addmm(o.float(), inp, w[k])).to(low))
    return out


def _lstm(args, low):
    x, (h, c), wih, whh, bih, bhh = args
    rx, rh, rwih, rwhh = (_r(t, low) for t in (x, h, wih, whh))
    gates = (as_list((rx @ rwih.t()).to(low)), as_list((rh @ rwhh.t()).to(low)))
    hy, cy, _ = lstm_model(as_list(rx), as_list(rh), as_list(c.to(low)), None, None, as_list(bih.to(low)),
                           as_list(bhh.to(low)), low, gates=gates)
    return tensor(hy, low), tensor(cy, low)


def _gru(args, low):
    x, h, wih, whh, bih, bhh = args
    rx, rh, rwih, rwhh = (_r(t, low) for t in (x, h, wih, whh))
    gates = (as_list((rx @ rwih.t()).to(low)), as_list((rh @ rwhh.t()).to(low)))
    hy, _ = gru_model(as_list(rx), as_list(rh), None, None, as_list(bih.to(low)), as_list(bhh.to(low)), low,
                      gates=gates)
    return tensor(hy, low)


def _simple_cell(act):
    def model(args, low):
        x, h, wih, whh, bih, bhh = _r(args, low)
        s = F.linear(h, whh, bhh).to(low).float() + F.linear(x, wih, bih).to(low).float()
        return act(s.to(low).float()).to(low)
    return model


def _addr(args, low):
    s, v1, v2 = (as_list(t.to(low)) for t in args)
    return tensor(addr_model(s, v1, v2, 1, 1, low), low)


def _addbmm(args, low):
    s, b1, b2 = _r(args, low)
    out = s
    for i in range(b1.shape[0]):
        out = (out + b1[i] @ b2[i]).to(low).float()  # addmm_ into the rounded result, beta = alpha = 1
    return out.to(low)


def _chain(args, low):
    """chain_matmul / linalg_multi_dot of three equal square matrices: (A @ B) @ C, each GEMM rounded."""
    a, b, c = _r(args if len(args) == 3 else args[0], low)
    return ((a @ b).to(low).float() @ c).to(low)


def _once(fn):
    """One GEMM-like op: fp32 from the rounded inputs, rounded once."""
    return lambda args, low: fn(*_r(args, low)).to(low)


LOW_MODELS = {
    "_convolution": lambda args, low: _cudnn_bias(torch._convolution(*_r(args[:2], low), None, *args[3:]), args[2],
                                                  low),
    "convolution": lambda args, low: _cudnn_bias(torch.convolution(*_r(args[:2], low), None, *args[3:]), args[2], low),
    "conv1d": _once(F.conv1d), "conv2d": _once(F.conv2d), "conv3d": _once(F.conv3d),
    "conv_transpose1d": _once(F.conv_transpose1d), "conv_transpose2d": _once(F.conv_transpose2d),
    "conv_transpose3d": _once(F.conv_transpose3d),
    "cudnn_convolution": lambda args, low: F.conv2d(*_r(args[:2], low), None, args[3], args[2], args[4],
                                                    args[5]).to(low),
    "cudnn_convolution_transpose": lambda args, low: F.conv_transpose2d(*_r(args[:2], low), None, args[4], args[2],
                                                                        args[3], args[6], args[5]).to(low),
    "conv_tbc": lambda args, low: _conv_tbc(*args[:3], args[3] if len(args) > 3 else 0, low),
    "prelu": lambda args, low: torch.where(_r(args[0], low) > 0, _r(args[0], low),
                                           _r(args[0], low) * _r(args[1], low)).to(low),
    "addmm": _once(torch.addmm), "addmv": _once(torch.addmv), "matmul": _once(torch.matmul),
    "__matmul__": _once(torch.matmul), "mm": _once(torch.mm), "mv": _once(torch.mv), "bmm": _once(torch.bmm),
    "baddbmm": _once(torch.baddbmm), "linear": _once(F.linear),
    "addr": _addr, "addbmm": _addbmm, "chain_matmul": _chain, "linalg_multi_dot": _chain,
    "linalg_vecdot": lambda args, low: (args[0].to(low) * args[1].to(low)).float().sum(-1).to(low),
    "lstm_cell": _lstm, "gru_cell": _gru,
    "rnn_tanh_cell": _simple_cell(torch.tanh), "rnn_relu_cell": _simple_cell(torch.relu),
}


def model_output(e: Entry, low: torch.dtype, variant) -> Any:
    """What CUDA computes for the entry (see the module docstring)."""
    if e.run_as == "low":
        return LOW_MODELS[e.op](e.args, low)
    run_as = e.run_as
    cast = _map(e.args, lambda v: v.to(run_as) if v.is_floating_point() else v)
    return variant(cast, e.kwargs)


def _compare(out: Any, ref: Any, what: str) -> None:
    if isinstance(out, torch.Tensor):
        assert isinstance(ref, torch.Tensor), f"{what}: model gave {type(ref).__name__}"
        assert out.dtype == ref.dtype and out.shape == ref.shape, \
            f"{what}: {out.dtype}{tuple(out.shape)} vs model {ref.dtype}{tuple(ref.shape)}"
        same = (out == ref) | (out.isnan() & ref.isnan()) if out.is_floating_point() else out == ref
        bad = int((~same).sum())
        assert bad == 0, (f"{what}: {bad}/{out.numel()} elements differ from the CUDA-kernel model; first: "
                          f"{out[~same].flatten()[0].item()!r} vs {ref[~same].flatten()[0].item()!r}")
    elif isinstance(out, collections.abc.Iterable):
        out, ref = list(out), list(ref)
        assert len(out) == len(ref), what
        for i, (a, b) in enumerate(zip(out, ref)):
            _compare(a, b, f"{what}[{i}]")
    else:
        assert out == ref, f"{what}: {out!r} vs model {ref!r}"


# ----------------------------------------------------------------------------------------------- tests


def test_the_lists_hold_what_this_emulation_was_checked_against(lists) -> None:
    held = {name: {raw[0] for raw in getattr(lists, name)} for name in LISTS}
    expected = dict(EXPECTED_OPS)
    # torch before 2.13: no rms_norm in CUDA autocast, nor in these lists
    expected["torch_fp32"] = expected["torch_fp32"] - (ADDED_IN_2_13 - registered_cuda_autocast_ops())
    for name, ops in expected.items():
        assert held[name] == ops, (
            f"torch {torch.__version__} changed AutocastTestLists.{name}: added {sorted(held[name] - ops)}, removed "
            f"{sorted(ops - held[name])}; check the emulation's table and kernel models for them, then update "
            "EXPECTED_OPS")
    skipped = {e.op for e in entries(lists) if e.skip}
    assert skipped == SKIPPED_BY_TORCH, f"entries torch's harness skips changed: {sorted(skipped)}"
    assert set(LOW_MODELS) >= EXPECTED_OPS["torch_fp16"] - SKIPPED_BY_TORCH | EXPECTED_OPS["nn_fp16"] | \
        EXPECTED_OPS["linalg_fp16"] | EXPECTED_OPS["methods_fp16"]


@pytest.mark.parametrize(("list_name", "index", "low"), ENTRY_PARAMS)
def test_entry_dtype_and_values_match_the_cuda_kernel_models(lists, list_name, index, low) -> None:
    e = _entry(lists, list_name, index)
    variants = _variants(e)
    assert variants, f"{e.id}: neither {e.module} nor torch.Tensor has {e.op}"
    if list_name == "banned":
        for _, call in variants:
            with pytest.raises(RuntimeError, match="unsafe to autocast"):
                run_emulated(e, low, call)
        return
    run_as = low if e.run_as == "low" else e.run_as
    out_type = e.out_type or run_as
    results = []
    for kind, call in variants:
        out = run_emulated(e, low, call)
        for t in _tensors(out):
            assert t.dtype == out_type, \
                f"{e.id} ({kind}) under emulated {low} autocast gave {t.dtype}, CUDA gives {out_type}"
        results.append((kind, call, out))
    if len(results) == 2:
        _compare(results[0][2], results[1][2], f"{e.id}: torch.{e.op} vs Tensor.{e.op}")
    kind, call, out = results[0]
    _compare(out, model_output(e, low, call), f"{e.id} ({kind}, {low})")


def _grad_leaves(e: Entry) -> tuple[Any, list[torch.Tensor]]:
    leaves: list[torch.Tensor] = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            t = t.detach().clone().requires_grad_(True)
            leaves.append(t)
        return t
    return _map(e.args, leaf), leaves


# Float64 stand-ins for ops with no CPU float64 kernel (the backward reference only).
REF_OPS = {
    "cudnn_convolution": lambda x, w, padding, stride, dilation, groups, *_: F.conv2d(x, w, None, stride, padding,
                                                                                       dilation, groups),
    "cudnn_convolution_transpose": lambda x, w, padding, output_padding, stride, dilation, groups, *_:
        F.conv_transpose2d(x, w, None, stride, padding, output_padding, groups, dilation),
}


@pytest.mark.parametrize(("list_name", "index", "low"), [p for p in ENTRY_PARAMS if p.values[0] != "banned"])
def test_entry_backward(lists, list_name, index, low) -> None:
    """Every entry whose op has a backward: gradients have their leaves' dtypes and lie within a few ulps of the
    run dtype of float64 autograd on the rounded inputs."""
    e = _entry(lists, list_name, index)
    kind, call = _variants(e)[0]
    args, leaves = _grad_leaves(e)
    with emulated_autocast(low):
        out = call(args, e.kwargs)
    outs = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
    if not outs or not leaves:
        pytest.skip(f"{e.op} has no backward for these arguments ({'no floating output' if not outs else 'no leaves'})")
    gen = torch.Generator().manual_seed(index)
    grads = [torch.randn(t.shape, generator=gen).to(t.dtype) for t in outs]
    torch.autograd.backward(outs, grads)

    run_as = low if e.run_as == "low" else e.run_as
    ref_args, ref_leaves = [], []

    def ref_leaf(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            src = t.to(run_as) if t.dtype != F64 else t
            t = src.double().requires_grad_(True)
            ref_leaves.append(t)
        return t
    ref_args = _map(e.args, ref_leaf)
    fn = REF_OPS.get(e.op)
    ref = fn(*ref_args, **e.kwargs) if fn else call(ref_args, e.kwargs)
    ref_outs = [t for t in _tensors(ref) if t.requires_grad]
    torch.autograd.backward(ref_outs, [g.double() for g in grads])

    for i, (leaf, rl) in enumerate(zip(leaves, ref_leaves)):
        assert leaf.grad is not None, f"{e.id}: input {i} got no gradient"
        assert leaf.grad.dtype == leaf.dtype, f"{e.id}: grad of input {i} is {leaf.grad.dtype}, input {leaf.dtype}"
        got, want = leaf.grad.double(), rl.grad
        # the gradient passes through at least one rounding to the run dtype (and the leaf's own dtype): 8 ulps
        # of fp16/bf16; where both are fp32, the fp32 kernels' own arithmetic over many terms (2^-14 relative)
        eps = max(torch.finfo(run_as).eps, torch.finfo(leaf.dtype).eps)
        eps = 8 * eps if eps > torch.finfo(F32).eps else 2.0 ** -14
        scale = want.abs().max().item() if want.numel() else 0.0
        tol = eps * (want.abs() + scale) + 1e-30
        bad = (got - want).abs() > tol
        assert not bad.any(), (f"{e.id}: grad of input {i}: {int(bad.sum())}/{got.numel()} elements further than "
                               f"the tolerance ({run_as}) from float64 autograd; worst {got[bad][0].item()!r} vs "
                               f"{want[bad][0].item()!r}")


def test_gemm_models_are_within_fp32_accumulation_of_float64(lists) -> None:
    """The one choice the models make for a GEMM, the fp32 summation order of torch's CPU kernels, is admissible:
    every GEMM-family entry's model is within the fp32 accumulation bound (+ one ulp) of float64 on the rounded
    inputs, rounded once."""
    one_gemm = {"conv1d": (F.conv1d, 8 * 8), "conv2d": (F.conv2d, 8 * 64), "conv3d": (F.conv3d, 8 * 512),
                "mm": (torch.mm, 8), "matmul": (torch.matmul, 8), "bmm": (torch.bmm, 8), "mv": (torch.mv, 8),
                "addmm": (torch.addmm, 9), "addmv": (torch.addmv, 9), "baddbmm": (torch.baddbmm, 9)}
    checked = 0
    for e in entries(lists):
        if e.list_name != "torch_fp16" or e.op not in one_gemm:
            continue
        fn, k = one_gemm[e.op]
        for low in (FP16, BF16):
            model = LOW_MODELS[e.op](e.args, low).double()
            exact = fn(*(t.to(low).double() for t in e.args))
            bound = 2 * k * 2.0 ** -24 * fn(*(t.to(low).double().abs() for t in e.args))
            lo_, hi_ = (exact - bound).to(low).double(), (exact + bound).to(low).double()
            assert ((model >= lo_) & (model <= hi_)).all(), f"{e.op} ({low}): fp32 model outside the fp32 bound"
            checked += 1
    assert checked == 2 * len(one_gemm)
