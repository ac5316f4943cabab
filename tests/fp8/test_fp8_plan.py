"""The FP8 plan (precision_audit/fp8/plan.py) on issue 16's planted layers at a size where FP8 pays on an H100:
the outlier-token layer goes rowwise, the outlier-channel layer stays in the main plan's format (no FP8 recipe
the H100 runs meets the budget there; MXFP8 would, on a CC 10.x target), the ordinary large layer goes FP8, the
small head stays; the chosen set is verified together against the model budget."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from precision_audit.fp8.measure import measure_fp8, result_record
from precision_audit.fp8.plan import make_verifier, plan_fp8
from precision_audit.gpus import resolve_target

# 2048-wide layers, the smallest at which FP8 pays on an H100 in the cost model: about 30 s of CPU
pytestmark = pytest.mark.slow

D, T, OUTLIER = 2048, 32, 2.0 ** 17


class Planted(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Linear(D, D)
        self.channels = nn.Linear(D, D)
        self.mlp = nn.Linear(D, D)
        self.head = nn.Linear(D, 64)
        gain = torch.ones(D)
        gain[32:64] = OUTLIER
        self.register_buffer("gain", gain)
        with torch.no_grad():
            self.channels.weight[:, 32:64] /= OUTLIER

    def forward(self, x):
        h = self.tokens(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = F.gelu(self.channels(h * self.gain))
        return self.head(F.gelu(self.mlp(h)))


@pytest.fixture(scope="module")
def planned():
    torch.manual_seed(0)
    model = Planted()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g)
    x[[3, 17]] *= OUTLIER
    y = torch.randn(T, 64, generator=g)
    fwd, loss_of = (lambda m: m(x)), (lambda o: F.mse_loss(o, y))
    r = measure_fp8(model, fwd, loss_of, ("fp8_tensorwise", "fp8_rowwise", "mxfp8"),
                    history_steps=1)
    verify = make_verifier(model, fwd, loss_of, r.reference_outputs)
    budget = dict(max_local_rel_error=0.05, max_loss_rel_change=0.05, max_output_rel_error=0.1)
    h100 = plan_fp8(r, resolve_target("h100"), tokens_per_step=65536, verify=verify,
                    recipes=("fp8_tensorwise", "fp8_rowwise"), **budget)
    return r, h100, budget


def test_plan_on_h100(planned):
    r, plan, _ = planned
    reasons = {n: c.reason for n, c in plan.choices.items()}
    assert plan.modules == {"tokens": "fp8_rowwise", "mlp": "fp8_tensorwise"}, reasons
    assert "fp8_tensorwise: local error" in plan.choices["tokens"].reason  # why not the faster tensorwise
    ch = plan.choices["channels"].reason
    assert "kept" in ch and "fp8_rowwise: local error" in ch
    assert "not worth converting" in plan.choices["head"].reason
    assert plan.verified is not None and plan.verified.meets_budget and plan.verified.modules == plan.modules
    assert 0.6 < plan.fp8_flop_share() < 0.7  # two of the three large layers (head is 1/32 of one)
    assert plan.estimated_speedup() > 1.0
    # MXFP8 meets the budget on the outlier-channel layer: a CC 10.x target could take it there
    d = result_record(r, 0.05)
    ch = next(L for L in d.layers if L.name == "channels").recipes
    assert ch["mxfp8"].meets_budget and not ch["fp8_rowwise"].meets_budget


def test_plan_without_fp8_tensor_cores_converts_nothing(planned):
    r, _, budget = planned
    a100 = plan_fp8(r, resolve_target("a100"), tokens_per_step=65536, recipes=("fp8_tensorwise", "fp8_rowwise"),
                    **budget)
    assert a100.modules == {} and "no Tensor Cores" in a100.choices["mlp"].reason


def test_model_budget_drops_the_module_that_moves_the_loss_most(planned):
    r, _, budget = planned
    seen = []

    def verify(mods):
        seen.append(dict(mods))
        from precision_audit.capture.stats import ErrorStats
        e = ErrorStats()
        e.update(torch.ones(4), torch.ones(4) * (1.5 if len(mods) > 1 else 1.0))
        return r.loss_fp32, e

    p = plan_fp8(r, resolve_target("h100"), tokens_per_step=65536, verify=verify,
                 recipes=("fp8_tensorwise", "fp8_rowwise"), **budget)
    assert len(seen) == 2 and len(p.modules) == 1 and len(p.dropped) == 1
    impacts = {L.name: abs(L.recipes[seen[0][L.name]].loss_impact) for L in r.layers if L.name in seen[0]}
    assert p.dropped[0] == max(impacts, key=impacts.get)
    assert "broke the model budget" in p.choices[p.dropped[0]].reason
