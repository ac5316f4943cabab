"""The runtime on a model with a TorchScript submodule: TorchScript modules take no Python hooks, so the
controller's source attribution (per-call hooks in adaptive mode) leaves them to their eager parent instead of
failing, and training steps run in both modes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import precision_audit as pa
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.jit.script(nn.Linear(16, 16))
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("adaptive", [False, True])
def test_controller_steps_a_model_with_a_scripted_submodule(adaptive):
    torch.manual_seed(0)
    model = Net()
    fp, n = fingerprint(model)
    policy = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                    target_compute_capability=(9, 0), default_format="fp32", modules={},
                    loss_scaling=LossScaling(enabled=False, init_scale=1024.0, growth_interval=10_000),
                    model_layout=model_layout(model))
    handle = pa.apply_policy(model, policy, device_type="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = pa.controller(model, opt, policy, adaptive=adaptive, device="cpu")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    before = model.b.weight.detach().clone()
    losses = []
    for _ in range(3):
        with pa.autocast(policy, "cpu"):
            loss = F.cross_entropy(model(x), y)
        ctl.step(loss)
        losses.append(float(loss))
    assert ctl.skipped_steps == 0
    assert not torch.equal(before, model.b.weight) and losses[-1] < losses[0]
    ctl.close()
    handle.remove()
