"""Frozen fp16/bf16 weights beside float32 trained ones (a bf16 base under float32 LoRA adapters): accepted, as the
model trains that way, but the FP32 reference then computes with those weights as stored, and audit.json says so
(assemble.frozen_low_precision_warning). A float32 model, or low-precision weights that are trained (refused at
loading), says nothing of the kind."""

from __future__ import annotations

import torch
from torch import nn

import precision_audit
from precision_audit import assemble


class Adapted(nn.Module):
    """A frozen base (bf16, computing in float32 from its stored weights) under a float32 adapter."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(32, 32)
        self.adapter = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = nn.functional.linear(x, self.base.weight.float(), self.base.bias.float()) + self.adapter(x)
        return self.head(torch.relu(h))


def _model(base_dtype: torch.dtype) -> Adapted:
    torch.manual_seed(0)
    m = Adapted()
    m.base.to(base_dtype).requires_grad_(False)
    return m


def test_the_share_and_names_of_frozen_low_precision_weights():
    said = assemble.frozen_low_precision_warning(_model(torch.bfloat16))
    total = 32 * 32 + 32 + 32 * 32 + 32 * 4 + 4
    assert len(said) == 1
    assert said[0].startswith(f"2 frozen parameter tensors ({100 * (32 * 32 + 32) / total:.0f}% of the model's "
                              "values: base.weight, base.bias) are stored in bfloat16")
    assert "not an all-FP32 pass" in said[0]
    assert assemble.frozen_low_precision_warning(_model(torch.float32)) == []
    # frozen but float32: the reference is all FP32
    m = _model(torch.float32)
    m.head.requires_grad_(False)
    assert assemble.frozen_low_precision_warning(m) == []
    mixed = _model(torch.float16)
    mixed.head.half().requires_grad_(False)
    assert "are stored in float16" in assemble.frozen_low_precision_warning(mixed)[0]
    assert "4 frozen parameter tensors" in assemble.frozen_low_precision_warning(mixed)[0]


def test_the_audit_says_it_once():
    x = torch.randn(16, 32)

    def loss_fn(out, batch):
        return out.float().pow(2).mean()

    low = precision_audit.audit(_model(torch.bfloat16), x, loss_fn=loss_fn, steps=0, progress=False)
    low = low.audit["warnings"]
    assert sum("frozen parameter tensors" in w for w in low) == 1, low
    full = precision_audit.audit(_model(torch.float32), x, loss_fn=loss_fn, steps=0, progress=False)
    full = full.audit["warnings"]
    assert not any("frozen parameter tensors" in w for w in full), full
