"""The FP8 runtime (precision_audit/fp8/apply.py): the planned modules, and only those, converted through
torchao's convert_to_float8_training with their own recipe; 20 emulated training steps on CPU stay finite and
learn; recipes torchao cannot train are refused before the model is touched; the policy's fp8 section."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from precision_audit.errors import PolicyError
from precision_audit.fp8.policy import Fp8Plan
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout
from precision_audit.policy.io import dumps_policy, parse_policy

torchao = pytest.importorskip("torchao", reason="torchao is not installed (pip install '.[fp8]')")

from precision_audit.fp8.apply import apply_fp8  # noqa: E402


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def test_twenty_emulated_steps_convert_exactly_the_planned_modules():
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    model = Net()
    converted = apply_fp8(model, {"fc1": "fp8_tensorwise", "fc2": "fp8_rowwise_gw_hp"}, emulate=True)
    assert converted == ["fc1", "fc2"]
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    # fc2's recipe keeps a GEMM in high precision: torchao's Float8Linear, autocast-safe (test_fp8_autocast.py)
    assert kinds == {"fc1": "Float8Linear", "fc2": "AutocastSafeFloat8Linear", "head": "Linear"}
    # each module has its own recipe's config
    assert model.fc1.config.cast_config_grad_output.target_dtype == torch.float8_e5m2  # tensorwise: E5M2 grads
    assert not model.fc1.config.round_scales_to_power_of_2
    assert model.fc2.config.round_scales_to_power_of_2  # rowwise family
    assert model.fc2.config.cast_config_input_for_grad_weight.scaling_type.name == "DISABLED"  # weight grad in HP
    assert model.fc1.config.emulate and model.fc2.config.emulate
    assert isinstance(model.fc1, Float8Linear) and isinstance(model.fc2, Float8Linear)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    y = torch.randn(32, 16, generator=g)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("recipe", ["fp8_delayed", "mxfp8", "nvfp4"])
def test_recipes_without_a_torchao_training_path_are_refused(recipe):
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PolicyError, match="torchao"):
        apply_fp8(model, {"fc1": "fp8_tensorwise", "fc2": recipe}, emulate=True)
    assert type(model.fc1) is nn.Linear  # nothing converted, not even the module that could be
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_module_names_and_types_are_refused():
    model = Net()
    with pytest.raises(PolicyError, match="no such module"):
        apply_fp8(model, {"fc9": "fp8_tensorwise"}, emulate=True)
    seq = nn.Sequential(nn.Conv1d(4, 4, 1))
    with pytest.raises(PolicyError, match="only nn.Linear"):
        apply_fp8(seq, {"0": "fp8_tensorwise"}, emulate=True)


def test_real_fp8_needs_multiples_of_16():
    model = nn.Sequential(nn.Linear(24, 16))
    with pytest.raises(PolicyError, match="multiples of 16"):
        apply_fp8(model, {"0": "fp8_tensorwise"}, emulate=False)


def test_policy_carries_the_recipe_and_v1_policies_still_load():
    model = Net()
    fp, n = fingerprint(model)
    plan = Fp8Plan.from_dict({"modules": {"fc1": {"recipe": "fp8_rowwise", "reason": "local error 3.6e-02"}}})
    pol = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                 target_compute_capability=(9, 0), default_format="bf16", modules={}, loss_scaling=LossScaling(),
                 model_layout=model_layout(model), extra={"fp8": plan.to_dict()})
    back = parse_policy(dumps_policy(pol))
    assert Fp8Plan.from_policy(back) == plan
    v1 = Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                target_compute_capability=(9, 0), default_format="bf16", modules={}, loss_scaling=LossScaling())
    assert Fp8Plan.from_policy(parse_policy(dumps_policy(v1))).modules == {}
    assert apply_fp8(model, parse_policy(dumps_policy(v1))) == []
    assert apply_fp8(model, back, emulate=True) == ["fc1"]
    with pytest.raises(PolicyError, match="recipe"):
        Fp8Plan.from_dict({"modules": {"fc1": {"recipe": "fp9"}}})
