"""A model whose loss is a registered loss module's output (DistilBERT's ``mlm_loss_fct``, any model holding an
``nn.CrossEntropyLoss()`` as a submodule): that module's output gradient is dL/dL = 1, an FP32 scalar that no
format computes, so it must not set the FP16 loss scale. The independent reference is the same model computing its
loss with ``F.cross_entropy`` inline, which has no such module output."""

from __future__ import annotations

import json

import pytest

from precision_audit.cli import main

MODEL = """
import torch, torch.nn as nn, torch.nn.functional as F
class ViewLoss(nn.Module):
    def forward(s, logits, labels):
        return F.cross_entropy(logits, labels).unsqueeze(0)
class M(nn.Module):
    def __init__(s):
        super().__init__()
        s.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
        s.loss_fct = nn.CrossEntropyLoss()
        s.view_loss = ViewLoss()
    def forward(s, x, labels):
        logits = s.net(x)
        loss = {loss}
        return {{'loss': loss, 'logits': logits}}
def build_model():
    torch.manual_seed(0); return M()
def sample_batch():
    g = torch.Generator().manual_seed(0)
    return {{'x': torch.randn(64, 32, generator=g), 'labels': torch.randint(0, 10, (64,), generator=g)}}
"""
LOSSES = {
    "inline": "F.cross_entropy(logits, labels)",
    "module": "s.loss_fct(logits, labels)",
    "module, shape [1]": "s.loss_fct(logits, labels).reshape(1)",  # the audit reshapes it to a scalar (a view)
    "module returning a view": "s.view_loss(logits, labels)",  # the module's output is itself a view
}


def test_the_loss_modules_own_gradient_does_not_set_the_loss_scale(tmp_path):
    scales = {}
    for name, loss in LOSSES.items():
        d = tmp_path / name.replace(",", "").replace(" ", "_")
        d.mkdir()
        (d / "model.py").write_text(MODEL.format(loss=loss))
        assert main([str(d / "model.py"), "--out", str(d / "out"), "-q"]) == 0
        scales[name] = json.loads((d / "out" / "audit.json").read_text())["loss_scale"]
    inline = scales["inline"]
    assert inline["max_abs_grad"] < 0.5  # so counting dL/dL = 1 would lower the scale: the test can tell
    for name, s in scales.items():
        # inline, the loss is the root module's own output, known by identity too
        assert s["gradients"]["loss_gradient_excluded"] == pytest.approx(1.0), name
        assert "loss_fct" not in s["gradients"]["largest_in"], name
        for key in ("recommended_init_scale", "max_no_overflow_scale", "max_abs_grad", "flushed_fraction"):
            assert s[key] == inline[key], (name, key)
