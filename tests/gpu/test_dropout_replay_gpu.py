"""Attention dropout replayed across dtypes (capture/rng_replay.py; docs/memory.md, "Random draws in cuda mode").

The bf16 pass must drop the same attention weights as the FP32 reference. In the passes, attention with dropout
runs on the memory-efficient kernel, replayed by running it from the reference's generator state: that relies on
the kernel drawing each element's mask from its position and the generator's state, whatever the dtype. On a GPU
(``gpu`` marker) this checks exactly that, on the kernel itself; on the fake device (tests/fakecuda.py) the same
code runs the math backend, whose dropout mask is recomputed from the recorded state.

The mask is read off the output: with q = k = 0 every query attends to every key with weight 1/S, and with
v = the identity (head dim = S) output[i, j] is row i's weight on key j, dropped or not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fakecuda import gpu  # noqa: F401 - the fixture
from precision_audit.capture.rng_replay import RandomDraws, recording, replaying

S = 64


def _mask(out: torch.Tensor) -> torch.Tensor:
    return out.float() != 0


def test_attention_dropout_in_bf16_replays_the_fp32_references_mask(gpu):
    q = torch.zeros(2, 4, S, S, device="cuda")
    v = torch.eye(S, device="cuda").expand(2, 4, S, S).contiguous()
    draws = RandomDraws()
    torch.manual_seed(0)
    with recording(draws):
        ref = F.scaled_dot_product_attention(q, q, v, dropout_p=0.3)
    assert len(draws) == 1
    kept = _mask(ref).float().mean().item()
    assert 0.6 < kept < 0.8, f"{kept:.3f} of the weights kept at dropout 0.3"
    torch.manual_seed(1)
    torch.rand(1000, device="cuda")  # the bf16 pass's generator is elsewhere (other draws before)
    with replaying(draws) as r:
        out = F.scaled_dot_product_attention(q.bfloat16(), q.bfloat16(), v.bfloat16(), dropout_p=0.3)
    assert r.mismatches == 0 and r.replayed == 1
    assert torch.equal(_mask(out), _mask(ref)), \
        f"{int((_mask(out) != _mask(ref)).sum())} attention weights dropped in one dtype and kept in the other"
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=0)  # 1/S / 0.7, rounded to bf16
