"""The FP32 reference's finiteness check (capture/reference_pass.py): with a finite loss it does no work over the
outputs, and the count its message gives is exact, made a block at a time.

On an H200 (2026-11-28) the check's ``(~isfinite(out)).sum()`` over a GPT's logits made an int64 copy of them
inside CUDA's sum of a bool mask (8 bytes an element: 3.4 GiB of 32 x 256 x 50257 logits), at the moment the forward's
activations were all alive: the audit's peak GPU memory was 1.34x a training step's, this temporary most of it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from precision_audit.capture.reference_pass import ReferencePass
from precision_audit.capture.stats import CHUNK, nonfinite_elements
from precision_audit.errors import NumericsError


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.sizes += [(str(func), a.numel()) for a in args if isinstance(a, torch.Tensor)]
        return func(*args, **(kwargs or {}))


def test_a_finite_loss_reads_none_of_the_outputs():
    out = (torch.randn(64, 1000), torch.randn(8, 3))
    loss = out[0].mean() + out[1].mean()
    with _Ops() as ops:
        ReferencePass._check_finite_reference(out, loss, float(loss))
    assert not [s for s in ops.sizes if s[1] > 1], f"work over the outputs: {ops.sizes}"


def test_a_nonfinite_loss_is_refused_with_the_exact_count():
    y = torch.randn(4, 5)
    y[0, 1], y[2, 2], y[3, 4] = math.nan, math.inf, -math.inf
    z = torch.zeros(3)
    z[1] = math.nan
    with pytest.raises(NumericsError) as e:
        ReferencePass._check_finite_reference((y, z), y.sum(), float(y.sum()))
    assert "4 non-finite output element(s)" in e.value.found


def test_the_count_across_blocks_and_layouts():
    n = CHUNK * 2 + 1024  # three blocks
    x = torch.zeros(n)
    where = [0, CHUNK - 1, CHUNK, n - 1]  # the blocks' edges
    x[where] = torch.tensor([math.nan, math.inf, -math.inf, math.nan])
    assert nonfinite_elements(x) == 4
    assert nonfinite_elements(x.reshape(-1, 1024).t()) == 4  # not contiguous
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 5, 9]]), torch.tensor([1.0, math.inf, math.nan]), (10,))
    assert nonfinite_elements(sparse) == 2
    assert nonfinite_elements(torch.randn(3, 4, dtype=torch.bfloat16)) == 0
