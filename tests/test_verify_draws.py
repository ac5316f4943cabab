"""`precision-audit verify` on a GPU: every arm's step k sees the FP32 arm's dropout masks of step k (verify.py,
_StepDraws; docs/gpu.md), shown under the fake device (tests/fakecuda.py), whose dropout draws other masks in
bf16 than in fp32 at the same seed, as CUDA's kernel does."""

from __future__ import annotations

import torch
from torch import nn

from fakecuda import FakeCuda
from precision_audit.model_names import fingerprint, model_layout
from precision_audit.policy.schema import LossScaling, Policy
from precision_audit.verify import VerifyOptions, run_verify

STEPS = 3


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        return self.out(self.drop(self.lin(x)))


def test_every_arm_trains_on_the_fp32_arms_masks_step_by_step():
    masks: list[torch.Tensor] = []
    with FakeCuda(cuda_dropout=True):
        torch.manual_seed(0)
        model = Dropped().train().to("cuda")
        model.drop.register_forward_hook(lambda m, args, out: masks.append(out.detach() == 0))
        x = torch.randn(64, 32, device="cuda")
        fp, n = fingerprint(model)
        policy = Policy(model_class="Dropped", model_fingerprint=fp, model_modules=n, target_name="test",
                        target_compute_capability=None, default_format="bf16", modules={},
                        loss_scaling=LossScaling(), model_layout=model_layout(model))
        v = run_verify(model, lambda m: m(x), lambda out: out.float().pow(2).mean(), policy, "cuda", "cuda",
                       VerifyOptions(steps=STEPS, optimizer="sgd", lr=0.05))
    arms = list(v.curves)
    assert arms == ["fp32", "policy", "bf16", "fp16"] and len(masks) == len(arms) * STEPS
    fp32 = masks[:STEPS]
    assert not torch.equal(fp32[0], fp32[1]), "each step draws its own masks"
    for a, arm in enumerate(arms[1:], 1):
        for k in range(STEPS):
            assert torch.equal(masks[a * STEPS + k], fp32[k]), f"{arm} step {k}: other masks than the FP32 arm's"
    # so the arms differ by their arithmetic alone: bf16's rounding, not half of the hidden units
    for arm in ("policy", "bf16", "fp16"):
        assert v.final_loss_rel_change[arm] < 0.02, (arm, v.final_loss_rel_change)
        assert v.param_rel_change[arm] < 0.01, (arm, v.param_rel_change)
