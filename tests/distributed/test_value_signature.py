"""What the ranks compare to tell a replicated tensor (precision_audit/distributed/session.py ``value_signature``):
the same figures as a whole-tensor float64 sum, made a block at a time, so that no float64 copy of a module output
is made (over a GPT's logits at batch 32 the whole-tensor version asked ~50 bytes an element of the GPU)."""

from __future__ import annotations

import math

import torch
from dispatch_probes import LargestOutput

from precision_audit.capture.stats import CHUNK
from precision_audit.distributed.session import value_signature


def test_a_hand_made_signature():
    x = torch.tensor([[1.0, 2.0], [math.nan, 3.0]])
    # size 4; finite sum 6, squares 14, by position 1*1 + 2*2 + 4*3 = 17; one non-finite element
    assert value_signature(x) == [4.0, 6.0, 14.0, 17.0, 1.0]
    assert value_signature(torch.tensor([True, False, True])) == [3.0, 2.0, 2.0, 4.0, 0.0]


def test_blocks_give_the_whole_tensors_figures_and_no_float64_copy_of_it():
    n = 2 * CHUNK + 1000  # three blocks
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-8, 9, (n,), generator=g).float()  # small integers: every float64 sum below is exact
    x[[5, CHUNK + 3]] = torch.tensor([math.inf, math.nan])
    finite = torch.where(torch.isfinite(x), x, 0.0).double()
    pos = torch.arange(1, n + 1, dtype=torch.float64)
    want = [float(n), float(finite.sum()), float((finite * finite).sum()), float((finite * pos).sum()), 2.0]
    shaped = x.view(2, -1)  # a module output of two rows
    with LargestOutput() as seen:
        got = value_signature(shaped)
    assert got == want
    assert seen.largest <= CHUNK * 8, f"an op made {seen.largest} bytes: a float64 copy larger than a block"
    moved = x.clone()
    moved[[0, 1]] = moved[[1, 0]]  # the same values in another order: another signature
    if moved[0] != moved[1]:
        assert value_signature(moved) != got
