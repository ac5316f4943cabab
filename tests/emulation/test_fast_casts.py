"""The compiled kernels' fast float32 <-> bfloat16 casts (emulation/_emulation_kernels.cpp, "Fast casts").

They replace torch's ``x.to(bf16).to(float)`` (and the single casts) inside the compiled kernels by one loop and
hand-made autograd nodes, so they must be invisible: the same bits as torch's own casts on hand-made boundary cases
(ties to even both ways, the largest finite values and those that round to inf, subnormals, zeros, infs, NaNs with
their payloads) and on random tensors, the same autograd graph (ToCopyBackward0 chains, which capture/memory.py and
distributed/saved.py read), the same gradients, and the same ops for a dispatch mode (the capture's op tracker).
Each comparison is against torch's own cast, computed without the library, and against the library with the fast
casts off (``set_fast_casts(False)``: the kernels as they were before).

(A one-off check also ran every float32 bit pattern through the round trip and every bfloat16 pattern through the
widening: no difference; bench/README.md, "P2".)
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

from precision_audit.distributed.saved import recipe_of
from precision_audit.emulation import compiled, rounding
from precision_audit.emulation.autocast import CudaAutocastPolicy, emulated_autocast
from test_compiled_kernels import _toolchain_missing

BF16, FP16 = torch.bfloat16, torch.float16

pytestmark = pytest.mark.skipif(_toolchain_missing() is not None,
                                reason=f"cannot build the compiled kernels: {_toolchain_missing()}")


@pytest.fixture(scope="module")
def ops(built_kernels):
    d, _ = built_kernels
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRECISION_AUDIT_KERNEL_DIR", str(d))
        assert compiled.load()
        lib = compiled.ops()
        assert lib.fast_casts()  # the probe agreed with torch's casts on this CPU
        yield lib
        lib.set_fast_casts(True)
    compiled._loaded = None


def _f32(*bits: int) -> torch.Tensor:
    return torch.tensor([struct.unpack("<f", struct.pack("<I", b))[0] for b in bits], dtype=torch.float32)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


# float32 bit patterns around every rounding decision bf16 makes
BOUNDARIES = _f32(
    0x00000000, 0x80000000,                          # +-0
    0x00000001, 0x80000001, 0x00007FFF, 0x00008000,  # the smallest subnormals; below / at a tie to zero
    0x00018000, 0x00008001, 0x007FFFFF, 0x807FFFFF,  # a tie up to odd; just above a tie; the largest subnormals
    0x00800000, 0x3F800000, 0xBF800000,              # the smallest normal, +-1
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # ties: to even (down), to even (up), negative both
    0x3F807FFF, 0x3F808001,                          # just below / above a tie
    0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,  # the largest bf16 (stays), ties and max float32 (-> inf)
    0x7F800000, 0xFF800000,                          # +-inf
    0x477FE000, 0x33800000, 0x3EAAAAAB, 0xC2F6E979,  # fp16 max, 2^-24, 1/3, -123.456
)


def _rounded_by_the_kernels(x: torch.Tensor, dtype: torch.dtype = BF16) -> torch.Tensor:
    """What the compiled linear kernel hands the GEMM for ``x``: its rounded copy, read from the rounding registry
    (a column times a weight of ones; the registry keeps every rounded operand, the input first)."""
    reg = rounding.start_rounding_registry()
    try:
        with CudaAutocastPolicy("compiled"), emulated_autocast(dtype):
            F.linear(x.reshape(-1, 1), torch.ones(1, 1))
        rounding._drain_compiled()
        got = next(iter(reg.values())).tensor
    finally:
        rounding.stop_rounding_registry()
    assert got.shape == (x.numel(), 1)
    return got.reshape(x.shape)


def _to_copy_calls(fn) -> int:
    with profile() as p:
        fn()
    return sum(e.count for e in p.key_averages() if e.key == "aten::_to_copy")


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "torch-casts"])
def test_the_round_trip_is_torchs_on_boundaries_random_bits_and_nans(ops, fast) -> None:
    ops.set_fast_casts(fast)
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-2**31, 2**31, (100_003,), generator=g, dtype=torch.int64).to(torch.int32)
    random_bits = random_bits[~random_bits.view(torch.float32).isnan()]  # NaNs apart (next case)
    cases = [BOUNDARIES, BOUNDARIES[7:8], random_bits.view(torch.float32), torch.randn(64, 48, generator=g),
             torch.randn(1000, generator=g) * 1e-39]  # subnormals throughout
    for x in cases:
        # in a vector-length multiple and with a scalar tail, at several offsets
        for y in (x, torch.cat([x, x[:5]]), torch.cat([x[:3], x])):
            assert torch.equal(_bits(_rounded_by_the_kernels(y)), _bits(y.to(BF16).float()))
    # NaNs: torch's vectorised and scalar casts write different payloads; the kernels must write torch's
    nan = torch.cat([BOUNDARIES, _f32(0x7FC00000, 0xFFC00001, 0x7F800001, 0x7FBFFFFF)] * 5)
    assert torch.equal(_bits(_rounded_by_the_kernels(nan)), _bits(nan.to(BF16).float()))
    # bf16 tensors widen exactly: every bf16 bit pattern, NaNs included
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(BF16)
    assert torch.equal(_bits(_rounded_by_the_kernels(every)), _bits(every.float()))


def test_the_fast_casts_replace_torchs_only_where_they_apply(ops) -> None:
    """Plain tensors: no aten::_to_copy at all in the forward (the casts of x, weight and output); under a dispatch
    mode, or for fp16, torch's casts as before, so that a mode sees exactly the ops it saw."""
    x, w = torch.randn(4, 8), torch.randn(3, 8, requires_grad=True)

    def fwd(dtype):
        with CudaAutocastPolicy("compiled"), emulated_autocast(dtype):
            return F.linear(x, w)

    ops.set_fast_casts(True)
    assert _to_copy_calls(lambda: fwd(BF16)) == 0
    assert _to_copy_calls(lambda: fwd(FP16)) == 5  # x, w (down and up), the output
    ops.set_fast_casts(False)
    assert _to_copy_calls(lambda: fwd(BF16)) == 5

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    seen = []
    for fast in (True, False):
        ops.set_fast_casts(fast)
        w.grad = None
        with Log() as log:
            fwd(BF16).float().sum().backward()
        seen.append(log.seen)
    # forward: x, w twice, y, .float(); backward: w twice, y, .float()
    assert seen[0] == seen[1] and seen[0].count("aten._to_copy.default") == 6 + 4


def _graph(fn) -> list:
    """The autograd graph under ``fn``'s grad_fn as nested (node name, [children]), depth first."""
    if fn is None:
        return []
    return [type(fn).__name__, [_graph(nf) for nf, _ in fn.next_functions]]


@pytest.mark.parametrize("low", [BF16, FP16], ids=["bf16", "fp16"])
def test_an_mlp_step_is_bit_identical_with_the_same_graph(ops, low) -> None:
    """Outputs, loss and every gradient of a small MLP step (linear -> relu -> linear -> gelu -> linear ->
    cross-entropy, the sample MLP's shape), fast casts against torch's casts and the Python kernels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
    x, target = torch.randn(16, 24), torch.randint(0, 8, (16,))
    runs = []
    for kernels, fast in (("compiled", True), ("compiled", False), ("python", True)):
        ops.set_fast_casts(fast)
        model.zero_grad(set_to_none=True)
        with CudaAutocastPolicy(kernels), emulated_autocast(low):
            out = model(x)
            loss = F.cross_entropy(out, target)
        graph = _graph(loss.grad_fn)
        loss.backward()
        runs.append(([out.detach(), loss.detach()] + [p.grad for p in model.parameters()], graph))
    (ref, ref_graph), *others = runs
    for values, graph in others:
        assert graph == ref_graph
        for a, b in zip(ref, values):
            assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def test_weight_copies_are_still_recognised_and_no_grad_makes_no_nodes(ops) -> None:
    ops.set_fast_casts(True)
    w, b = torch.randn(3, 8, requires_grad=True), torch.randn(3, requires_grad=True)
    with CudaAutocastPolicy("compiled"), emulated_autocast(BF16):
        y = F.linear(torch.randn(4, 8, requires_grad=True), w, b)  # an input that needs a grad: mat2 is saved
        assert y.grad_fn is not None
        addmm: Any = y.grad_fn.next_functions[0][0]
        assert type(y.grad_fn).__name__ == "ToCopyBackward0" and type(addmm).__name__ == "AddmmBackward0"
        saved_weight = addmm._saved_mat2  # weight_cast.t(): TBackward0 -> ToCopyBackward0 x2 -> AccumulateGrad
        recipe = recipe_of(saved_weight)  # what FSDP's counter makes it again from (distributed/saved.py)
        assert recipe is not None and recipe.param is w and recipe.dtypes == (BF16, torch.float32)
        assert torch.equal(saved_weight.t(), w.detach().to(BF16).float())
        with torch.no_grad():
            z = F.linear(torch.randn(4, 8), w, b)
        assert z.grad_fn is None and not z.requires_grad and z.dtype == BF16
        with torch.inference_mode():  # torch's casts there (inference tensors)
            assert F.linear(torch.randn(4, 8), w, b).is_inference()
