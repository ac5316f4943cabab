"""`verify`'s FP8 arm (issue 16, docs/fp8.md "verify"): a policy with an ``fp8`` key trains a ``policy_fp8`` arm,
the policy with its planned linears converted through torchao (emulated on CPU). Checked against a hand-written
loop of the same steps; a plan the runtime cannot apply is refused before any training (exit 2)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from precision_audit.errors import PolicyError
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout
from precision_audit.verify import VerifyOptions, policy_failure, run_verify

torchao = pytest.importorskip("torchao", reason="torchao is not installed (pip install '.[fp8]')")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        return self.head(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


def _policy(model: nn.Module, fp8: dict[str, str]) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class="Net", model_fingerprint=fp, model_modules=n, target_name="H100 SXM",
                  target_compute_capability=(9, 0), default_format="fp32", modules={}, loss_scaling=LossScaling(),
                  model_layout=model_layout(model),
                  extra={"fp8": {"modules": {k: {"recipe": r, "reason": "test"} for k, r in fp8.items()}}})


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)


def test_the_fp8_arm_trains_the_planned_modules_in_fp8_as_a_hand_loop_does():
    from precision_audit.fp8.apply import apply_fp8

    torch.manual_seed(0)
    model = Net()
    x, y = _batch()
    plan = {"fc1": "fp8_tensorwise", "fc2": "fp8_rowwise"}
    pol = _policy(model, plan)
    opts = VerifyOptions(steps=5, lr=1e-2, optimizer="adam", seed=0)
    r = run_verify(model, lambda m: m(x), lambda o: F.mse_loss(o, y), pol, "cpu", "emulated", opts)
    assert list(r.curves) == ["fp32", "policy", "policy_fp8", "bf16", "fp16"]
    assert r.policy_safe and not r.errors
    # independent reference: the same steps written out, the modules converted with emulate=True
    ref = copy.deepcopy(model)
    assert apply_fp8(ref, plan, emulate=True) == ["fc1", "fc2"]
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    hand = []
    for _ in range(5):
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        hand.append(float(loss.detach()))
    assert r.curves["policy_fp8"] == hand
    # FP8 changed the numbers (the arm is not the FP32 policy arm again), by little
    assert r.curves["policy_fp8"] != r.curves["policy"]
    assert r.curves["policy"] == r.curves["fp32"]
    assert 0 < r.final_loss_rel_change["policy_fp8"] < 0.05
    assert type(model.fc1) is nn.Linear  # the user's model is untouched


def test_a_policy_without_fp8_has_no_fp8_arm():
    model = Net()
    x, y = _batch()
    r = run_verify(model, lambda m: m(x), lambda o: F.mse_loss(o, y), _policy(model, {}), "cpu", "emulated",
                   VerifyOptions(steps=1))
    assert list(r.curves) == ["fp32", "policy", "bf16", "fp16"]


def test_an_fp8_plan_the_runtime_cannot_apply_is_refused_before_training():
    model = Net()
    x, y = _batch()
    said: list[str] = []
    with pytest.raises(PolicyError, match="delayed scaling"):
        run_verify(model, lambda m: m(x), lambda o: F.mse_loss(o, y), _policy(model, {"fc1": "fp8_delayed"}),
                   "cpu", "emulated", VerifyOptions(steps=2), said.append)
    assert said == []  # no arm started
    assert type(model.fc1) is nn.Linear


def test_a_diverging_fp8_arm_makes_the_policy_unsafe():
    curve = [1.0, None]
    why = policy_failure({}, curve, [], "policy_fp8")
    assert why is not None and "FP8" in why and "policy_fp8" in why
    assert "policy_fp8" in (policy_failure({"policy_fp8": "RuntimeError: x"}, [1.0], []
                                           , "policy_fp8") or "")
    assert policy_failure({}, [1.0], [torch.tensor([math.inf])], "policy_fp8") is not None


def test_verify_command_adds_the_fp8_arm_and_refuses_what_torchao_cannot_train(tmp_path, capsys):
    from conftest import ROOT
    from precision_audit.cli import main

    mlp = ROOT / "sample_models" / "mlp"
    out = tmp_path / "o"
    args = [str(mlp / "model.py"), "--batch", str(mlp / "sample.pt")]
    assert main(args + ["--out", str(out), "-q", "--steps", "0"]) == 0
    pol = json.loads((out / "policy.json").read_text())
    pol["fp8"] = {"modules": {"fc1": {"recipe": "fp8_tensorwise", "reason": "test"}}}
    (out / "policy.json").write_text(json.dumps(pol))
    assert main(["verify"] + args + ["--policy", str(out / "policy.json"), "--out", str(out), "--steps", "3",
                                     "-q"]) == 0
    v = json.loads((out / "audit.json").read_text())["verify"]
    assert "policy_fp8" in v["curves"] and all(c is not None for c in v["curves"]["policy_fp8"])
    assert "policy_fp8" in capsys.readouterr().out
    pol["fp8"]["modules"]["fc1"]["recipe"] = "mxfp8"
    (out / "policy.json").write_text(json.dumps(pol))
    before = (out / "audit.json").read_text()
    assert main(["verify"] + args + ["--policy", str(out / "policy.json"), "--out", str(out), "--steps", "3",
                                     "-q"]) == 2
    assert "MXFP8" in capsys.readouterr().err
    assert (out / "audit.json").read_text() == before  # nothing half-written


def test_on_an_fp8_gpu_the_check_applies_the_real_kernels_rules(monkeypatch):
    """In cuda mode on compute capability 9.0 the arm runs torchao's real kernels, which need dimensions that are
    multiples of 16: the check before training says so (exit 2) rather than the arm failing mid-run. No GPU is
    needed to check the decision: the capability is what torch would report on an H100."""
    from precision_audit.verify import check_fp8_arm

    model = nn.Sequential(nn.Linear(24, 16))
    pol = _policy(model, {"0": "fp8_tensorwise"})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(PolicyError, match="multiples of 16"):
        check_fp8_arm(model, pol, "cuda", "cuda:0")
    assert check_fp8_arm(model, pol, "emulated", "cpu")  # emulated: torchao has no such rule
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert check_fp8_arm(model, pol, "cuda", "cuda:0")  # an A100 emulates too
