"""A model that reseeds torch's generator from the OS in its forward (``torch.seed()``, as Hugging Face's
Reformer does in every layer) is audited on the same dropout masks in every pass (capture/reseeds.py)."""

from __future__ import annotations

import json

import torch

from precision_audit.capture.reseeds import ReproducibleReseeds
from precision_audit.cli import main

RESEEDS = """
import torch, torch.nn as nn
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.a = nn.Linear(32, 64); s.drop = nn.Dropout(0.5); s.b = nn.Linear(64, 4)
    def forward(s, x):
        torch.manual_seed(torch.seed() % 2**62)  # Reformer's _init_attention_seed, on a CPU
        return s.b(s.drop(torch.relu(s.a(x))))
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
"""


def test_reseeds_from_the_os_are_drawn_from_the_generator_while_on():
    before = (torch.seed, torch.random.seed)
    with ReproducibleReseeds() as r:
        torch.manual_seed(3)
        a = (torch.seed(), torch.rand(4))
        torch.manual_seed(3)
        b = (torch.seed(), torch.rand(4))
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and r.calls == 2
    assert (torch.seed, torch.random.seed) == before  # put back
    torch.manual_seed(3)
    assert torch.seed() != a[0]  # the OS's again (equal by chance: 1 in 2^63)


def test_a_model_that_reseeds_in_its_forward_is_compared_on_the_same_masks(tmp_path):
    src = tmp_path / "model.py"
    src.write_text(RESEEDS)
    seed = torch.seed
    assert main([str(src), "--out", str(tmp_path / "out"), "-q"]) == 0
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    # the same masks in every pass: FP32 at its two orders agrees, and bf16's error is rounding, not dropout
    assert audit["noise_floor"]["fp32_output_rel_error"] < 1e-5
    assert audit["summary"]["bf16"]["output"]["rel_l2"] < 2e-2
    assert sum("torch.seed()" in w for w in audit["warnings"]) == 1
    assert torch.seed is seed and torch.random.seed is seed  # put back after the audit

