"""The cast policy of every op in the emulation's table, observed from torch's real AutocastCUDA kernels.

The start-up check (autocast_policy.check_registrations) compares op names only, and the fake-CUDA dtype oracle of
tests/emulation/test_emulation.py compares output dtypes, which cannot tell fp32 from fp32-with-dtype, and cannot run
an op whose CUDA body fails on a CPU-only build. Here every table op is called on fake CUDA tensors with CUDA
autocast on, and a probe kernel registered on the AutogradCUDA key (the first key below AutocastCUDA) records what
the autocast kernel hands on (the op overload, the dtypes of its floating tensors, its ``dtype`` argument) and stops
the call. Three calls per op (all-fp32 inputs, all-fp16/bf16 inputs, mixed) classify the policy:

- lower_precision_fp: fp32 inputs arrive as fp16/bf16;
- fp32: fp16/bf16 inputs arrive as fp32;
- fp32_set_opt_dtype: fp16/bf16 inputs arrive unchanged with ``dtype=float32``;
- fp32_append_dtype: the call arrives at another overload, with ``dtype=float32``;
- promote: fp16/bf16 inputs arrive unchanged, mixed inputs arrive as fp32;
- banned: the autocast kernel raises before the probe.

The observed policy must equal CUDA_POLICY's for every table op the installed torch registers, under fp16 and bf16,
so a torch whose autocast moves an op to another policy fails here; a table op it does not register (rms_norm before
torch 2.13) must show no policy, as the emulation then leaves it alone. In-process and fast (no op bodies run).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from precision_audit.emulation.autocast_policy import CUDA_POLICY, CastPolicy, installed_policy
from test_emulation import RECIPES, Inputs

FP16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
_A = torch.ops.aten

# Ops whose CPU build has no kernel, so test_emulation has no recipe for them; the probe stops them before any
# kernel runs, so they can be called here.
CUDA_ONLY_RECIPES = {
    "_scaled_dot_product_flash_attention": lambda I: _A._scaled_dot_product_flash_attention(
        I.x(1, 2, 4, 8), I.x(1, 2, 4, 8), I.x(1, 2, 4, 8)),
    "_thnn_fused_lstm_cell": lambda I: _A._thnn_fused_lstm_cell(I.x(3, 20), I.x(3, 20), I.x(3, 5), I.x(20), I.x(20)),
    "_thnn_fused_gru_cell": lambda I: _A._thnn_fused_gru_cell(I.x(3, 15), I.x(3, 15), I.x(3, 5), I.x(15), I.x(15)),
    "cudnn_convolution": lambda I: torch.cudnn_convolution(I.x(1, 2, 5, 5), I.x(3, 2, 3, 3), (0, 0), (1, 1), (1, 1),
                                                           1, False, True, True),
    "cudnn_convolution_transpose": lambda I: torch.cudnn_convolution_transpose(
        I.x(1, 2, 5, 5), I.x(2, 3, 3, 3), (0, 0), (0, 0), (1, 1), (1, 1), 1, False, True, True),
}
ALL_RECIPES = {**RECIPES, **CUDA_ONLY_RECIPES}


class _Probed(Exception):
    def __init__(self, record: dict) -> None:
        super().__init__(record["op"])
        self.record = record


def _floating(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _floating(v)


def _probe(name: str):
    def kernel(*args, **kwargs):
        dtypes = [str(t.dtype) for t in _floating((args, list(kwargs.values())))]
        raise _Probed({"op": name, "dtypes": dtypes, "dtype_arg": str(kwargs.get("dtype", _dtype_positional(name,
                                                                                                             args)))})
    return kernel


def _dtype_positional(name: str, args: tuple) -> Any:
    base, _, overload = name.partition(".")
    op = getattr(getattr(_A, base), overload or "default")
    for i, a in enumerate(op._schema.arguments):
        if a.name == "dtype" and i < len(args):
            return args[i]
    return None


def probed_overloads() -> list[str]:
    """The table's ops, and their sibling overloads that take a ``dtype`` (where an fp32_append_dtype kernel
    redispatches). Other siblings (``upsample_nearest2d.vec``, which F.interpolate calls) are left alone: they
    have no autocast kernel and decompose into the table's overload, which is then probed."""
    names = set(CUDA_POLICY)
    for base in {n.partition(".")[0] for n in CUDA_POLICY}:
        for overload in getattr(_A, base).overloads():
            op = getattr(getattr(_A, base), overload)
            if any(a.name == "dtype" for a in op._schema.arguments):
                names.add(base if overload == "default" else f"{base}.{overload}")
    return sorted(names)


@contextmanager
def probes() -> Iterator[None]:
    """Probe kernels on AutogradCUDA (see probed_overloads)."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in probed_overloads():
                lib.impl(name, _probe(name), "AutogradCUDA")
        yield
    finally:
        lib._destroy()


def observe(name: str, low: torch.dtype, roles: tuple[str, ...]) -> dict | str:
    """What the AutocastCUDA kernel of ``name``'s recipe hands on, for inputs of the given dtype roles."""
    dtypes = tuple({"low": low, "fp32": F32}[r] for r in roles)
    torch.manual_seed(0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", low)
        torch.autocast_increment_nesting()
        try:
            ALL_RECIPES[name](Inputs(dtypes, low, device="cuda"))
        except _Probed as p:
            return p.record
        except Exception as e:  # noqa: BLE001 - a banned op raises in its autocast kernel
            return f"raises:{type(e).__name__}: {e}"
        finally:
            torch.autocast_decrement_nesting()
            torch.set_autocast_enabled("cuda", False)
    return "not reached"


def classify(name: str, low: torch.dtype) -> str:
    from_fp32 = observe(name, low, ("fp32",))
    if isinstance(from_fp32, str):
        return CastPolicy.BANNED.value if "unsafe to autocast" in from_fp32 else f"unobserved ({from_fp32[:200]})"
    if from_fp32["dtypes"] and all(d == str(low) for d in from_fp32["dtypes"]):
        return CastPolicy.LOWER_PRECISION_FP.value
    from_low = observe(name, low, ("low",))
    if isinstance(from_low, str):
        return f"unobserved ({from_low[:200]})"
    same_op = from_low["op"] == name
    if same_op and from_low["dtypes"] and all(d == str(F32) for d in from_low["dtypes"]):
        return CastPolicy.FP32.value
    if from_low["dtype_arg"] == str(F32):
        return (CastPolicy.FP32_SET_OPT_DTYPE if same_op else CastPolicy.FP32_APPEND_DTYPE).value
    mixed = observe(name, low, ("low", "fp32"))
    if (all(d == str(low) for d in from_low["dtypes"]) and not isinstance(mixed, str)
            and all(d == str(F32) for d in mixed["dtypes"])):
        return CastPolicy.PROMOTE.value
    return f"none (fp32 inputs: {from_fp32}, low inputs: {from_low}, mixed: {mixed})"


@pytest.fixture(scope="module")
def observed() -> dict[tuple[str, torch.dtype], str]:
    with probes():
        return {(name, low): classify(name, low) for name in sorted(CUDA_POLICY) for low in (FP16, BF16)}


def test_every_table_op_has_a_probe_call() -> None:
    assert set(CUDA_POLICY) <= set(ALL_RECIPES), f"no call for {sorted(set(CUDA_POLICY) - set(ALL_RECIPES))}"


@pytest.mark.parametrize("low", [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16")])
def test_every_table_op_has_the_policy_cuda_autocast_applies(observed, low) -> None:
    installed = installed_policy()
    wrong = {name: (policy.value, observed[(name, low)]) for name, policy in sorted(installed.items())
             if observed[(name, low)] != policy.value}
    assert not wrong, (f"torch {torch.__version__}'s AutocastCUDA kernels apply other policies than the emulation's "
                       f"table (op: (table, observed)): {wrong}")
    assert {observed[(n, low)] for n in installed} == {p.value for p in CastPolicy}, "a policy was never observed"
    # the table ops this torch does not register: no policy at all, so the emulation rightly leaves them alone
    left_alone = {n: observed[(n, low)] for n in sorted(set(CUDA_POLICY) - set(installed))}
    assert all(v.startswith("none") for v in left_alone.values()), left_alone


def test_the_probe_tells_policies_apart() -> None:
    """The classifier itself, on ops whose policies are known to differ only in how the dtype is passed."""
    with probes():
        assert classify("softmax.int", FP16) == "fp32_set_opt_dtype"
        assert classify("norm.Scalar", FP16) == "fp32_append_dtype"
        assert classify("layer_norm", FP16) == "fp32"
        rec = observe("norm.Scalar", FP16, ("low",))
        assert rec["op"] == "norm.ScalarOpt_dtype" and rec["dtypes"] == ["torch.float16"], rec
    # and the probes are gone afterwards
    assert torch.softmax(torch.randn(3), 0).dtype == F32


@pytest.mark.parametrize("name", ["_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "cudnn_convolution",
                                  "cudnn_convolution_transpose"])
@pytest.mark.parametrize("low", [pytest.param(FP16, id="fp16"), pytest.param(BF16, id="bf16")])
def test_cuda_only_ops_run_under_the_emulation(name, low) -> None:
    """No CPU kernel exists for them, but the emulation computes them (docs/emulation.md), in the low dtype."""
    from precision_audit.emulation.autocast import CudaAutocastPolicy, emulated_autocast

    torch.manual_seed(0)
    with CudaAutocastPolicy(), emulated_autocast(low):
        out = CUDA_ONLY_RECIPES[name](Inputs((F32,), low))
    outs = out if isinstance(out, tuple) else (out,)
    assert all(t.dtype == low for t in outs), [t.dtype for t in outs]
