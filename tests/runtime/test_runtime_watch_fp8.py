"""Issue 36, the planted FP8 delayed-scaling case: an amax rising faster than the history tracks.

sample_models/fp8_delayed_growth trains a linear regression whose inputs' scale grows faster and faster, so that
``head``'s input amax grows by a rising factor per step; the policy
runs the model in bf16 and its FP8 plan puts ``head`` under ``fp8_delayed`` (Transformer Engine's DelayedScaling).
The runtime runs no FP8 (runtime/watch_fp8.py says why), so the saturation step T is found by running the same
training with the exact model of the recipe, fp8/quant.py's ``DelayedScaler`` (history 1024, margin 0, max), fed
each step's amax of the three tensors it scales (``head``'s input, weight and output gradient). With
``watch=True`` the forecast names ``head`` ahead of T, and the plan's recipe for it is changed before T.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import precision_audit as pa
from precision_audit import load_policy
from precision_audit.fp8.policy import Fp8Plan
from precision_audit.fp8.quant import E4M3, E5M2, DelayedScaler, elem_overflow_from
from precision_audit.policy import LossScaling, Policy, fingerprint, model_layout
from precision_audit.runtime.watch_fp8 import OVERFLOW, saturation_limit

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
_spec = importlib.util.spec_from_file_location("sample_fp8_delayed_growth",
                                               ROOT / "sample_models" / "fp8_delayed_growth" / "model.py")
growth = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(growth)


def _policy(model: nn.Module) -> Policy:
    fp, n = fingerprint(model)
    return Policy(model_class=type(model).__name__, model_fingerprint=fp, model_modules=n, target_name="test",
                  target_compute_capability=(9, 0), default_format="bf16", loss_scaling=LossScaling(enabled=False),
                  model_layout=model_layout(model),
                  extra={"fp8": {"modules": {"head": {"recipe": "fp8_delayed", "reason": "planted"}}}})


def _train(steps: int, *, watch: bool, **batch_kw) -> tuple:
    """Train the sample; the reference DelayedScalers see every step's amaxes. Returns (controller, the first
    saturated step of each of head's tensors (None: never))."""
    model = growth.build_model()
    policy = _policy(model)
    handle = pa.apply_policy(model, policy)
    ctl = pa.controller(model, torch.optim.SGD(model.parameters(), lr=0.2), policy, watch=watch, device="cpu")
    te = {"input": DelayedScaler(E4M3), "weight": DelayedScaler(E4M3), "grad_output": DelayedScaler(E5M2)}
    seen: dict[str, float] = {}

    def hook(module, args, out):
        seen["input"] = args[0].detach().abs().max().item()
        seen["weight"] = module.weight.detach().abs().max().item()
        out.register_hook(lambda g: seen.__setitem__("grad_output", g.abs().max().item()))

    h = model.head.register_forward_hook(hook)
    for t in range(1, steps + 1):
        x, y = growth.batch_at(t, **batch_kw)
        with pa.autocast(policy, "cpu"):
            loss = growth.loss_fn(model(x), (x, y))
        ctl.step(loss)
        for role, scaler in te.items():
            scaler.observe(seen[role])
    h.remove()
    handle.remove()
    ctl.close()
    return ctl, {role: s.stale_steps[0] + 1 if s.stale_steps else None for role, s in te.items()}


def test_the_watch_replans_head_before_delayed_scaling_saturates(tmp_path):
    _, first = _train(300, watch=False)
    t_sat = min(v for v in first.values() if v is not None)
    role = min((v, r) for r, v in first.items() if v is not None)[1]
    assert role == "input" and 150 < t_sat < 300, first  # the planted case, as measured (225)
    ctl, _ = _train(t_sat, watch=True)
    acts = [(a.module, a.kind, a.change) for a in ctl.watch.actions]
    assert acts == [("head", "fp8_recipe", "fp8_delayed -> fp8_rowwise")], acts
    act = ctl.watch.actions[0]
    assert act.step < t_sat
    assert "its input" in act.reason and "outrun the delayed E4M3 scale" in act.reason
    # the forecast acted on names head's input and puts the saturation within 15% of T
    fc = ctl.watch.forecasts[("head", "fp8_delayed", "saturation_input")]
    made = [e for e in ctl.watch.log if e["at"] == act.step and e["kind"] == "saturation_input"]
    assert made and made[-1]["module"] == "head" and abs(made[-1]["step"] - t_sat) <= 0.15 * t_sat, (made, t_sat)
    assert fc.step is not None
    assert not [e for e in ctl.watch.log if e["module"] != "head"], "nothing else approaches a limit"
    # the adapted policy's FP8 plan, saved and loaded back; the module formats are untouched
    assert Fp8Plan.from_policy(ctl.policy).modules["head"].recipe == "fp8_rowwise"
    assert ctl.policy.modules == {}
    ctl.save_policy(tmp_path / "policy.json")
    saved = Fp8Plan.from_policy(load_policy(tmp_path / "policy.json")).modules["head"]
    assert saved.recipe == "fp8_rowwise" and "forecast to outrun" in saved.reason
    series = ctl.watch.to_dict()["modules"]["head"]
    assert len(series["fp8_input"]) == len(series["step"]) == len(series["fp8_weight"])
    assert "fp8_input" not in ctl.watch.to_dict()["modules"]["body"]


def test_a_steady_growth_that_delayed_scaling_tracks_is_left_alone():
    # the inputs growing 0.03 log2 per step: below E4M3's 0.0506, so the history's scale covers the next step
    ctl, first = _train(200, watch=True, accel=0.0, rate=0.03)
    assert first == {"input": None, "weight": None, "grad_output": None}
    assert ctl.watch.actions == []
    assert Fp8Plan.from_policy(ctl.policy).modules["head"].recipe == "fp8_delayed"


@pytest.mark.parametrize("kind, limit", [("saturation_weight", 464 / 448), ("saturation_grad_output", 61440 / 57344)])
def test_the_saturation_limit_is_the_formats_rounding_margin(kind, limit):
    assert OVERFLOW == {E4M3: elem_overflow_from(E4M3), E5M2: elem_overflow_from(E5M2)}  # the runtime's own copy
    assert saturation_limit(kind) == pytest.approx(math.log2(limit), rel=1e-5)
    assert saturation_limit(kind, margin=1) == pytest.approx(math.log2(limit) + 1, rel=1e-5)
