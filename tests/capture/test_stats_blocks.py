"""The Python statistics read a large tensor a block at a time (capture/stats.py, ``blocks``; docs/memory.md,
"Statistics' temporaries"): the same counts and (to summation order) the same sums as one whole-tensor pass, and
no temporary larger than a block's.

On a GPU these temporaries (float64 copies, masks, bucket indices: ~30 bytes per element together) on the largest
output set the audit's peak memory: 1.7-1.8x a training step on GPT-2 and T5 at batch 32 before this
(bench/README.md, "On a GPU").
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from precision_audit.capture import stats
from precision_audit.capture.stats import ErrorStats, MagnitudeHistogram, RangeSummary, blocks, dot64, python_statistics


@pytest.mark.parametrize("shape", [(10,), (3, 10), (2, 3, 5), (7, 1, 9), (1, 100), (4, 4, 4, 4)])
@pytest.mark.parametrize("chunk", [1, 4, 7, 30, 1000])
def test_blocks_cover_every_element_once_in_memory_order(shape, chunk):
    n = math.prod(shape)
    t = torch.arange(n).reshape(shape)
    parts = [t[i].reshape(-1) if i else t.reshape(-1) for i in blocks(shape, chunk)]
    assert torch.equal(torch.cat(parts), torch.arange(n))
    assert all(p.numel() <= max(chunk, 1) for p in parts) or n <= chunk


def _awkward(n: int, seed: int) -> torch.Tensor:
    """Values across the float32 range: normals, subnormals, zeros, a NaN and infinities."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-140, 100, (n,), generator=g).float())
    x[::97] = 0.0
    x[5], x[17], x[1234] = float("nan"), float("inf"), -float("inf")
    return x


def _all_stats(ref: torch.Tensor, p: torch.Tensor):
    h, s, e = MagnitudeHistogram(), RangeSummary(), ErrorStats()
    h.update(p)
    s.update(p)
    e.update(ref, p)
    return h, s, e, dot64(ref.nan_to_num(0.0, 0.0, 0.0), p.nan_to_num(0.0, 0.0, 0.0))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_blocked_statistics_equal_one_whole_pass(monkeypatch, layout):
    ref = _awkward(60 * 70, 0).reshape(60, 70)
    p = (ref + 1e-3 * _awkward(60 * 70, 1).reshape(60, 70).nan_to_num(0.0, 0.0, 0.0)).to(torch.bfloat16).float()
    ref[3, 3] = float("nan")  # a non-finite reference element is left out of the error sums
    if layout == "transposed":
        ref, p = ref.t(), p.t()
    with python_statistics():
        whole = _all_stats(ref, p)
        monkeypatch.setattr(stats, "CHUNK", 64)
        assert len(list(blocks(ref.shape))) > 60
        blocked = _all_stats(ref, p)
    (h1, s1, e1, d1), (h2, s2, e2, d2) = whole, blocked
    assert torch.equal(h1.counts, h2.counts)
    assert (h1.total, h1.zeros, h1.nans, h1.infs, h1.amax) == (h2.total, h2.zeros, h2.nans, h2.infs, h2.amax)
    assert (s1.total, s1.zeros, s1.nans, s1.infs, s1.amax) == (s2.total, s2.zeros, s2.nans, s2.infs, s2.amax)
    assert (e1.n, e1.nonfinite, e1.ref_nonfinite) == (e2.n, e2.nonfinite, e2.ref_nonfinite)
    assert e1.ref_nonfinite == 4  # the NaN and the two infinities of ref, and its planted NaN
    for a, b in [(e1.sum_ref2, e2.sum_ref2), (e1.sum_diff2, e2.sum_diff2), (e1.sum_dot, e2.sum_dot),
                 (e1.sum_p2, e2.sum_p2), (d1, d2)]:
        assert math.isfinite(a) and a == pytest.approx(b, rel=1e-12)
    assert e1.max_abs == e2.max_abs


def _storages(value) -> set[int]:
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage().data_ptr()}
    if isinstance(value, (tuple, list)):
        return set().union(*(_storages(v) for v in value)) if value else set()
    if isinstance(value, dict):
        return _storages(list(value.values()))
    return set()


class _LargestOutput(TorchDispatchMode):
    """The most bytes any one op allocated for its output (views of an input allocate nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.most = max(self.most, t.untyped_storage().nbytes())
        return out


@pytest.mark.parametrize("which", ["histogram", "summary", "error", "dot64"])
def test_no_temporary_is_larger_than_a_block(monkeypatch, which):
    """A 256K-element tensor, blocks of 1024: every op's output fits a block's float64/int64 copy (8 KiB);
    a whole-tensor pass makes 2 MiB ones."""
    monkeypatch.setattr(stats, "CHUNK", 1024)
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(256, 1024, generator=g)
    p = ref.to(torch.bfloat16)
    run = {"histogram": lambda: MagnitudeHistogram().update(ref),
           "summary": lambda: RangeSummary().update(ref),
           "error": lambda: ErrorStats().update(ref, p),
           "dot64": lambda: dot64(ref, p)}[which]
    with python_statistics():
        with _LargestOutput() as seen:
            run()
        assert seen.most <= 1024 * 8, f"{which}: a {seen.most}-byte temporary"
        monkeypatch.setattr(stats, "CHUNK", 1 << 30)
        with _LargestOutput() as whole:
            run()
        assert whole.most >= ref.numel() * 8 / 2, "the whole-tensor pass is what the blocks avoid"


def test_blocked_dot64_of_opposite_infinities_is_nan_as_one_sum(monkeypatch):
    """+inf in one block and -inf in another: one float64 sum gives NaN; so must the blocks (an exact summation
    of the block sums would raise instead, inside the FP32 backward's gradient hooks)."""
    g = torch.ones(4, 64)
    g[0, 0], g[3, 0] = math.inf, -math.inf
    d = torch.full((4, 64), 1e-3).to(torch.bfloat16)
    with python_statistics():
        whole = dot64(g, d)
        monkeypatch.setattr(stats, "CHUNK", 64)
        blocked = dot64(g, d)
    assert math.isnan(whole) and math.isnan(blocked)


def test_blocked_max_abs_ignores_a_nan_difference_as_one_pass_does(monkeypatch):
    """p NaN where ref is finite, and a large difference in another block: one pass's max is NaN, which leaves
    max_abs as it was; the blocks must not report the other block's maximum instead."""
    ref = torch.zeros(4, 64)
    p = torch.zeros(4, 64)
    p[0, 5], p[3, 7] = math.nan, 1e30
    with python_statistics():
        whole = ErrorStats()
        whole.update(ref, p)
        monkeypatch.setattr(stats, "CHUNK", 64)
        blocked = ErrorStats()
        blocked.update(ref, p)
    assert whole.max_abs == blocked.max_abs == 0.0
    assert whole.nonfinite == blocked.nonfinite == 1
