"""The controller with a sparse gradient (``nn.Embedding(sparse=True)``): every format trains, the total norm it
reports (and clips with) is the dense gradient's, and a non-finite step is skipped and named as with dense
gradients. The independent reference: the same model with a dense embedding, whose gradients hold the same values."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import precision_audit as pa
from tests.runtime.test_runtime_nonfinite import CASES, make_policy

STEPS = 6
BAD = 4  # the step whose loss is multiplied past the float range


class Net(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, sparse=sparse)
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def run(default: str, scaling: bool, sparse: bool, max_grad_norm: float | None):
    torch.manual_seed(0)
    model = Net(sparse)
    policy = make_policy(model, default, scaling)
    handle = pa.apply_policy(model, policy, device_type="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # SGD takes sparse gradients
    ctl = pa.controller(model, opt, policy, device="cpu", max_grad_norm=max_grad_norm)
    ids = torch.randint(0, 20, (8, 10), generator=torch.Generator().manual_seed(1))  # repeated tokens
    records = []
    for step in range(1, STEPS + 1):
        before = [p.detach().clone() for p in model.parameters()]
        with pa.autocast(policy, "cpu"):
            loss = model(ids).float().pow(2).mean() * (1e39 if step == BAD else 1.0)
        rec = ctl.step(loss)
        records.append((rec, all(torch.equal(b, p) for b, p in zip(before, model.parameters()))))
    handle.remove()
    ctl.close()
    return model, records


@pytest.mark.parametrize("max_grad_norm", [None, 0.05], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("default,scaling", CASES, ids=[f"{d}{'-scaler' if s else ''}" for d, s in CASES])
def test_sparse_gradients_train_as_their_dense_twin(default, scaling, max_grad_norm):
    sparse_model, sparse = run(default, scaling, True, max_grad_norm)
    dense_model, dense = run(default, scaling, False, max_grad_norm)
    for (rs, same_s), (rd, same_d) in zip(sparse, dense):
        assert rs.skipped == rd.skipped == (rs.step == BAD) == same_s == same_d, (rs, rd)
        if rs.skipped:
            assert not math.isfinite(rs.grad_norm) and rs.nonfinite_modules == rd.nonfinite_modules
        else:
            assert rs.grad_norm == pytest.approx(rd.grad_norm, rel=1e-6, abs=0.0) and rs.grad_norm > 0
    for ps, pd in zip(sparse_model.parameters(), dense_model.parameters()):
        torch.testing.assert_close(ps, pd, rtol=1e-5, atol=1e-7)
