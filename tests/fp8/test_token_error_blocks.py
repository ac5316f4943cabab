"""FP8's per-token error (precision_audit/fp8/measure.py ``TokenError``) made a block of rows at a time: the same
rows and worst row as over the whole tensor, the sum to float64 rounding, bit for bit in one block, and no float64
temporary larger than a block's (over a language model's logits the whole-tensor version made ~40 bytes an
element: on a GPU, the audit's peak)."""

from __future__ import annotations

import math

import torch
from dispatch_probes import LargestOutput

from precision_audit.capture.stats import CHUNK
from precision_audit.fp8.measure import TokenError


def _whole(r: torch.Tensor, p: torch.Tensor) -> tuple[int, float, float]:
    rr, qq = r.double().reshape(-1, r.shape[-1]), p.double().reshape(-1, r.shape[-1])
    n2, d2 = (rr * rr).sum(-1), ((qq - rr) ** 2).sum(-1)
    keep = (n2 > 0) & torch.isfinite(n2)
    rel2 = d2[keep] / n2[keep]
    return int(keep.sum()), float(rel2.sum()), float(rel2.max().sqrt())


def test_blocks_of_rows_give_the_whole_tensors_figures():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(5, 1000, 1000, generator=g)  # 5000 rows of 1000: three blocks of CHUNK // 1000 rows
    p = r + 1e-3 * torch.randn(r.shape, generator=g)
    r[0, 5] = 0.0  # a row left out
    rows, total, worst = _whole(r, p)
    e = TokenError()
    with LargestOutput() as seen:
        e.update(r, p)
    assert (e.rows, e.worst) == (rows, worst) and rows == 4999
    assert math.isclose(e.sum_rel2, total, rel_tol=1e-12)
    assert seen.largest <= CHUNK * 8, f"an op made {seen.largest} bytes: larger than a block's float64 copy"


def test_one_block_is_the_whole_tensor_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(64, 96, generator=g)
    p = r.bfloat16().float()
    e = TokenError()
    e.update(r, p)
    assert (e.rows, e.sum_rel2, e.worst) == _whole(r, p)
