"""A batch the model fits exactly (a random-init Funnel Transformer's tied-embedding logits reach ~500 on its own
input tokens: cross-entropy 0.0) gives an all-zero FP32 backward. The audit says so once, in its warnings and in
the loss-scale reason, instead of presenting zero gradients as measurements."""

from __future__ import annotations

import json

import torch

from precision_audit.cli import main

FITS = """
import torch, torch.nn as nn
def build_model():
    m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    with torch.no_grad():
        m[0].weight.copy_(torch.eye(8, 4) * 30.0); m[0].bias.zero_()
        m[1].weight.copy_(torch.eye(3, 8) * 100.0); m[1].bias.zero_()
    return m
def loss_fn(out, batch):
    return nn.functional.cross_entropy(out, torch.tensor([0, 1, 2]))
def sample_batch():
    return torch.eye(3, 4)
"""


def test_an_all_zero_backward_is_reported_not_measured(tmp_path):
    ns: dict = {}
    exec(FITS, ns)
    model = ns["build_model"]()
    x = ns["sample_batch"]()
    loss = ns["loss_fn"](model(x), x)
    loss.backward()
    assert float(loss) == 0.0 and all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())  # the premise
    src = tmp_path / "model.py"
    src.write_text(FITS)
    main([str(src), "--out", str(tmp_path / "out"), "-q"])
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    zero = [w for w in audit["warnings"] if w.startswith("every gradient of the FP32 backward is zero")]
    assert len(zero) == 1 and "loss 0" in zero[0], audit["warnings"]
    assert "gradients computed in FP16 is zero" in audit["loss_scale"]["reason"]


def test_a_model_with_gradients_gets_no_such_warning(tmp_path):
    src = tmp_path / "model.py"
    src.write_text(FITS.replace("* 100.0", "* 0.1"))
    main([str(src), "--out", str(tmp_path / "out"), "-q"])
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert not [w for w in audit["warnings"] if "every gradient" in w]
    assert torch.isfinite(torch.tensor(audit["loss_scale"]["max_abs_grad"])) and audit["loss_scale"]["max_abs_grad"] > 0
