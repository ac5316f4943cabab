"""Plans worth following (issue 12): never worse than the uniform format, reasons from the decision, calibrated
sensitivities, overflow refusals for every module, and verdicts that do not depend on the thread count.

Each situation is a small model written here, shaped like the real model where the problem was seen (ResNet-50:
uniform FP16 within budget while the per-module first-order sums overshoot; ViT-B/16: BF16 safe as is).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from precision_audit.analysis import cost
from precision_audit.analysis.findings import Budget, _summary
from precision_audit.audit import AuditOptions, compute_audit
from precision_audit.capture.noise import NoiseFloor, OrderRun
from precision_audit.capture.records import RunRecord
from precision_audit.capture.stats import ErrorStats
from precision_audit.formats import Format

RESNETISH = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ResNetish(nn.Module):
    def __init__(self, c=16, depth=6):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(depth)])
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def build_model():
    # seed 7: with the emulation's cuDNN bias rounding (docs/emulation.md) this init reproduces the situation:
    # FP16 within a 1e-4 budget, BF16 not, FP16's first-order sum over it
    torch.manual_seed(7)
    return ResNetish()


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g)
'''

VITISH = '''
import torch
from torch import nn


class TinyViT(nn.Module):
    def __init__(self, dim=32, depth=2, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(len(t), -1, -1), t], 1) + self.pos
        return self.head(self.norm(self.encoder(t))[:, 0])


def build_model():
    torch.manual_seed(0)
    return TinyViT()


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
'''

# An auxiliary head whose output the loss ignores (a pooler the loss does not use).
ZERO_GRAD = '''
import torch
from torch import nn


class WithAux(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"logits": self.head(h), "aux": self.aux(h)}


def build_model():
    torch.manual_seed(0)
    return WithAux()


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def loss_fn(out, batch):
    return torch.nn.functional.cross_entropy(out["logits"], batch[1])
'''

# An elementwise module (no GEMM) whose output overflows fp16, followed by a LayerNorm that brings it back.
ELEMENTWISE_OVERFLOW = '''
import torch
from torch import nn


class Scale(nn.Module):
    def forward(self, x):
        return x * 1e5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.scale = Scale()
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.norm(self.scale(self.fc1(x))))


def build_model():
    torch.manual_seed(0)
    return Net()


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
'''

# A container whose own op (the sum of two children) overflows fp16 while neither child does.
CONTAINER_OVERFLOW = '''
import torch
from torch import nn


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(16, 32)
        with torch.no_grad():
            self.b.weight.copy_(self.a.weight)
            self.b.bias.copy_(self.a.bias)

    def forward(self, x):
        return self.a(x) + self.b(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pair = Pair()
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.norm(self.pair(x)))


def build_model():
    torch.manual_seed(0)
    return Net()


def sample_batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    net = build_model()
    with torch.no_grad():
        peak = net.pair.a(x).abs().max().item()
    return x * (45000.0 / peak), torch.randint(0, 4, (8,), generator=g)
'''


def _write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name / "model.py"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return str(p)


def _audit(model: str, **kw):
    return compute_audit(AuditOptions(model=model, steps=0, **kw))


def _candidate(audit: dict, label: str) -> dict | None:
    return next((c for c in audit["plan"]["candidates"] if c["label"] == label), None)


def _brute_force_time(audit: dict) -> float:
    """The plan's step time summed by hand from audit.json: each layer's own estimate in its planned format, and
    the loss's (outside every module) in the plan's default format, as the estimates' assumptions state it."""
    import re

    total = 0.0
    for L in audit["layers"]:
        if L["cost"]:
            times = L["cost"]["estimated_step_time_s"]
            total += times.get(L["plan"]["format"], times["fp32"])
    line = next((s for s in audit["estimates"]["assumptions"] if s.startswith("the ops outside the model's")), "")
    loss = {f: float(v) * 1e-6 for f, v in re.findall(r"(\w+) ([0-9.e+-]+) µs", line)}
    return total + loss.get(audit["plan"]["default_format"], 0.0)


# --- item 1: never worse than uniform ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def resnetish(tmp_path_factory):
    """Uniform FP16 within a tight budget (1e-4) where BF16 is not, and FP16's first-order sum overshoots it."""
    model = _write(tmp_path_factory.mktemp("plans"), "resnetish", RESNETISH)
    return _audit(model, budget=Budget(max_loss_rel_change=1e-4))


def test_resnet_shaped_uniform_fp16_beats_the_overshooting_mixed_plan(resnetish):
    a = resnetish.audit
    plan = a["plan"]
    budget = 1e-4
    # the situation: FP16 measured within budget, BF16 not, and FP16's first-order sum over it
    assert a["summary"]["fp16"]["safe"] and not a["summary"]["bf16"]["safe"]
    assert plan["calibration"]["fp16"]["first_order_sum_rel"] > budget
    # the plan: uniform FP16, nothing overridden, with loss scaling (the FP16 pass ran at that scale)
    assert plan["chosen"] == "uniform fp16" and plan["default_format"] == "fp16"
    assert plan["overrides"] == {} and resnetish.policy.modules == {}
    assert resnetish.policy.loss_scaling.enabled
    assert plan["verification"]["loss_rel_change"] == pytest.approx(a["summary"]["fp16"]["loss_rel_change"])
    assert plan["verification"]["loss_rel_change"] <= budget
    # the mixed plan was a candidate, and lost on the same time basis
    mixed = _candidate(a, "mixed")
    assert mixed is not None and not mixed["chosen"]
    assert mixed["estimated_step_time_s"] >= plan["estimated_step_time_s"]


def test_the_plans_time_is_computed_exactly_as_each_uniform_formats(resnetish):
    a = resnetish.audit
    for f in ("fp32", "fp16", "bf16"):
        c = _candidate(a, f"uniform {f}")
        # same ops, same model, same sum: bit-identical to the all-format estimate
        assert c["estimated_step_time_s"] == a["summary"][f]["step_time"]["estimated_s"], f
    assert a["plan"]["estimated_step_time_s"] == a["summary"]["fp16"]["step_time"]["estimated_s"]
    assert a["plan"]["estimated_step_time_s"] == pytest.approx(_brute_force_time(a), rel=1e-6)  # the loss: 6 digits


def test_vit_shaped_bf16_safe_as_is_gives_uniform_bf16_without_scaler(tmp_path):
    c = _audit(_write(tmp_path, "vitish", VITISH))
    a = c.audit
    assert a["summary"]["bf16"]["safe"]
    assert a["plan"]["chosen"] == "uniform bf16"
    assert a["plan"]["overrides"] == {} and c.policy.modules == {}
    assert not c.policy.loss_scaling.enabled
    assert c.policy.default_format == "bf16"
    # FP16 is safe too, and estimated the same: fewer overrides and no loss scaling break the tie
    fp16 = _candidate(a, "uniform fp16")
    if fp16["within_budget"]:
        assert fp16["estimated_step_time_s"] == a["plan"]["estimated_step_time_s"]
    assert "no overrides" in a["verdict"]["message"]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """bench/models/planted_mlp.py at depth 6: BF16 breaks a 1e-3 budget in three planted modules only."""
    import os

    old = os.environ.get("PA_DEPTH")
    os.environ["PA_DEPTH"] = "6"
    try:
        return _audit(str(ROOT / "bench" / "models" / "planted_mlp.py"), formats=(Format.BF16,),
                      budget=Budget(max_loss_rel_change=1e-3))
    finally:
        if old is None:
            os.environ.pop("PA_DEPTH")
        else:
            os.environ["PA_DEPTH"] = old


def test_a_mixed_plan_is_returned_only_when_verified_and_faster(planted):
    a = planted.audit
    plan = a["plan"]
    assert not a["summary"]["bf16"]["safe"]
    assert plan["chosen"] == "mixed"
    assert plan["verification"]["within_budget"] and plan["verification"]["loss_rel_change"] <= 1e-3
    fastest = min(c["estimated_step_time_s"] for c in plan["candidates"]
                  if c["label"].startswith("uniform") and c["within_budget"])
    assert plan["estimated_step_time_s"] < fastest
    assert plan["estimated_step_time_s"] == pytest.approx(_brute_force_time(a), rel=1e-6)  # the loss: 6 digits
    held = {n for n, o in plan["overrides"].items() if o["format"] == "fp32"}
    assert held == {"blocks.0.fc2", "blocks.3.fc2", "blocks.4.fc2"}


# --- item 3: reasons from the decision, counts from the plan -------------------------------------------------


def test_override_reasons_name_the_replaced_format_the_figure_and_the_budget(planted):
    a = planted.audit
    for o in a["plan"]["overrides"].values():
        r = o["reason"]
        assert r.startswith(f"{o['format']} instead of {a['plan']['default_format']}"), r
        assert "budget 1.00e-03" in r, r
        assert any(ch.isdigit() for ch in r.split("budget")[0]) and "e-" in r, r  # a measured figure


def test_verdict_counts_come_from_the_plan(planted, resnetish):
    for c in (planted, resnetish):
        a = c.audit
        n = len(a["plan"]["overrides"])
        by: dict[str, int] = {}
        for o in a["plan"]["overrides"].values():
            by[o["format"]] = by.get(o["format"], 0) + 1
        msg = a["verdict"]["message"]
        if n:
            assert f"{n} module(s) overridden" in msg
            for f, k in by.items():
                assert f"{k} in {f}" in msg
        else:
            assert "no overrides" in msg
        assert "kept in fp32" not in msg


def test_modules_the_loss_ignores_are_labelled_and_left_at_the_default(tmp_path):
    c = _audit(_write(tmp_path, "aux", ZERO_GRAD))
    a = c.audit
    aux = next(L for L in a["layers"] if L["name"] == "aux")
    assert "aux" not in a["plan"]["overrides"]
    assert aux["plan"]["format"] == a["plan"]["default_format"]
    assert "cannot change the loss" in aux["plan"]["reason"] and "loss does not use it" in aux["plan"]["reason"]
    # and the mixed candidate, built by the planner, leaves it at its default as well
    assert "aux" not in c.plan.overrides


# --- item 7: overflow in any module refuses that format for it ------------------------------------------------


@pytest.fixture
def no_kernel_floor(monkeypatch):
    """These toy models are launch-bound: at the cost model's per-kernel floor every plan ties and uniform fp32 is
    returned (tests/analysis/test_cost_floor.py). The tests below are about the refusal logic, so the floor is off."""
    monkeypatch.setattr(cost, "KERNEL_FLOOR_S", 0.0)


def test_an_elementwise_module_that_overflows_fp16_is_refused_fp16(tmp_path, no_kernel_floor):
    c = _audit(_write(tmp_path, "scale", ELEMENTWISE_OVERFLOW), formats=(Format.FP16,))
    a = c.audit
    scale = next(L for L in a["layers"] if L["name"] == "scale")
    amax = scale["activation"]["amax"]
    assert amax > 65504
    o = a["plan"]["overrides"].get("scale")
    assert o is not None and o["format"] == "fp32", a["plan"]
    assert "instead of fp16" in o["reason"] and "65504" in o["reason"] and f"{amax:.3g}" in o["reason"]
    assert a["plan"]["chosen"] != "uniform fp16"
    assert not _candidate(a, "uniform fp16")["within_budget"]


def test_a_container_whose_own_op_overflows_fp16_runs_in_fp32_as_a_whole(tmp_path, no_kernel_floor):
    c = _audit(_write(tmp_path, "pair", CONTAINER_OVERFLOW), formats=(Format.FP16,))
    a = c.audit
    layers = {L["name"]: L for L in a["layers"]}
    assert layers["pair"]["activation"]["amax"] > 65504
    assert layers["pair.a"]["activation"]["amax"] < 65504 and layers["pair.b"]["activation"]["amax"] < 65504
    o = a["plan"]["overrides"].get("pair")
    assert o is not None, a["plan"]
    assert o["format"] == "fp32" and "65504" in o["reason"] and "instead of fp16" in o["reason"]
    # its children are not left in fp16 inside it (their outputs would meet in the overflowing sum)
    assert layers["pair.a"]["plan"]["format"] == "fp32" and layers["pair.b"]["plan"]["format"] == "fp32"
    assert "pair.a" not in a["plan"]["overrides"] and "pair.b" not in a["plan"]["overrides"]
    assert a["plan"]["chosen"] == "mixed" and a["plan"]["verification"]["within_budget"]


# --- item 2: sensitivities calibrated against measurement ----------------------------------------------------


def test_impacts_are_calibrated_against_the_measured_whole_format_change(resnetish, planted):
    for c in (resnetish, planted):
        cal = c.audit["plan"]["calibration"]
        for info in cal.values():
            if info["note"] is None:
                assert info["factor"] == pytest.approx(info["measured_loss_rel_change"] / info["first_order_sum_rel"])
    # a uniform plan's calibrated prediction is its format's measurement, so the two agree
    p = resnetish.audit["plan"]
    assert p["predicted_loss_rel_change"] == pytest.approx(p["verification"]["loss_rel_change"], rel=1e-9)
    assert p["first_order_loss_rel_change"] > 2 * p["verification"]["loss_rel_change"]  # what calibration fixed


def test_predicted_and_verified_agree_within_2x_or_the_plan_says_which_it_trusts(planted):
    p = planted.audit["plan"]
    pred, ver = p["predicted_loss_rel_change"], p["verification"]["loss_rel_change"]
    note = p["prediction"]
    assert note["trusted"] == "verified"
    ratio = max(pred, ver) / min(pred, ver)
    assert note["agree"] == (ratio <= 2.0)
    if not note["agree"]:
        assert "trusts the verification" in note["note"]


def test_calibration_is_not_taken_from_a_change_inside_the_noise_floor():
    from types import SimpleNamespace

    from precision_audit.planning.rules import calibrate

    def analysis(measured, floor):
        s = SimpleNamespace(loss_rel_change=measured, loss_rel_change_range=None)
        noise = SimpleNamespace(loss_rel=floor)
        return SimpleNamespace(reference_loss=2.0, summaries={Format.BF16: s}, noise=noise)

    cands = [SimpleNamespace(impact={Format.BF16: 0.01}), SimpleNamespace(impact={Format.BF16: 0.03})]
    f, info = calibrate(analysis(1e-3, 1e-6), cands, (Format.BF16,))
    assert f[Format.BF16] == pytest.approx(1e-3 * 2.0 / 0.04)
    f, info = calibrate(analysis(1e-7, 1e-6), cands, (Format.BF16,))
    assert f[Format.BF16] == 1.0 and "noise floor" in info["bf16"]["note"]


# --- item 6: the FP32 noise floor and the thread count -------------------------------------------------------


def _run(loss: float) -> RunRecord:
    out = ErrorStats()
    out.update(torch.ones(4), torch.full((4,), 1.001))
    return RunRecord(format=Format.BF16, loss=loss, output=out)


def _noise(loss: float, ref: float = 1.0) -> NoiseFloor:
    return NoiseFloor(method="test", threads=(2, 1), reference_loss=ref, loss_rel=0.0, output_rel_error=0.0,
                      runs={Format.BF16: OrderRun(loss=loss, output_rel_error=1e-3)})


def test_a_verdict_rests_on_both_reduction_orders_and_is_the_same_from_either():
    budget = Budget(max_loss_rel_change=1e-2)
    # 0.009 at one order, 0.011 at the other: over budget whichever order the audit ran with
    at_2 = _summary(_run(1.009), 1.0, budget, noise=_noise(1.011))
    at_1 = _summary(_run(1.011), 1.0, budget, noise=_noise(1.009))
    assert not at_2.safe and not at_1.safe
    assert at_2.verdict == at_1.verdict
    assert at_2.loss_rel_change_range == pytest.approx(at_1.loss_rel_change_range)
    # without the second order the 0.009 run alone would have passed: the pair is what decides
    assert _summary(_run(1.009), 1.0, budget).safe


def test_the_noise_floor_is_measured_and_reported(resnetish):
    nf = resnetish.audit["noise_floor"]
    main = torch.get_num_threads()
    assert nf["threads"] == [main, 1 if main > 1 else 2]
    assert nf["fp32_loss_rel"] >= 0 and nf["fp32_output_rel_error"] >= 0
    assert nf["fp32_layers_rel_l2"] and all(v >= 0 for v in nf["fp32_layers_rel_l2"].values())
    for f in ("fp16", "bf16"):
        second = nf["second_order"][f]
        assert second["loss_rel_change"] is not None and math.isfinite(second["loss_rel_change"])


def _decisions(model: str, threads: int, **kw) -> dict:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = _audit(model, **kw).audit
    finally:
        torch.set_num_threads(old)
    # the decisions, not the figures: a figure far from its threshold is measured at the audit's own order only
    # (docs/plan.md, "Noise floor"), so its text differs with the thread count while the decision cannot
    return {"verdict": a["verdict"], "safe": {f: a["summary"][f]["safe"] for f in a["formats"]},
            "default": a["plan"]["default_format"], "chosen": a["plan"]["chosen"],
            "overrides": {n: o["format"] for n, o in a["plan"]["overrides"].items()},
            "layers": {L["name"]: L["plan"]["format"] for L in a["layers"]}}


@pytest.mark.parametrize("sample", ["cnn", "tiny_gpt"])
def test_same_verdicts_and_plans_at_1_and_2_threads(sample):
    model = str(ROOT / "sample_models" / sample / "model.py")
    assert _decisions(model, 1) == _decisions(model, 2)


@pytest.mark.slow
@pytest.mark.parametrize("sample", ["mlp", "fp16_trouble"])
def test_same_verdicts_and_plans_at_1_and_2_threads_other_samples(sample):
    model = str(ROOT / "sample_models" / sample / "model.py")
    assert _decisions(model, 1) == _decisions(model, 2)


# --- the repair loop ----------------------------------------------------------------------------------------


def test_a_repair_pins_the_most_sensitive_modules_and_gives_back_what_the_budget_did_not_need():
    """Ten modules in bf16; the budget holds once m0 and m1 are in fp32 (a brute-force answer known by design).
    Repairs pin m0, then half the rest (m1..m4); the give-back returns m2..m4 to bf16."""
    from types import SimpleNamespace

    from precision_audit.planning.rules import LayerPlan, Plan
    from precision_audit.planning.select import PlanCandidate, _verify_and_repair

    names = [f"m{i}" for i in range(10)]
    plan = Plan(default_format=Format.BF16, default_reason="test", source="planner")
    for n in names:
        plan.layers[n] = LayerPlan(Format.BF16, "default format")
    analysis = SimpleNamespace(budget=Budget(max_loss_rel_change=1e-2), reference_loss=1.0)
    result = SimpleNamespace(decisions={n: None for n in names})
    calls = []

    def verify(policy, default):
        fp32 = {n for n, lp in plan.layers.items() if lp.format is Format.FP32}
        calls.append(sorted(fp32))
        lc = 0.02 if not {"m0", "m1"} <= fp32 else 0.005
        return [lc, lc], [0.01, 0.01], None, 1.0 + lc

    mc = PlanCandidate("mixed", plan, 1.0)
    _verify_and_repair(analysis, mc, result, verify, lambda p: p, lambda n, f: 1.0 / (1 + int(n[1:])))
    assert mc.within_budget
    assert set(plan.overrides) == {"m0", "m1"}
    assert all(plan.layers[n].format is Format.BF16 for n in names[2:])
    assert calls[:3] == [[], ["m0"], ["m0", "m1", "m2", "m3", "m4"]]
    assert plan.overrides["m1"].reason.startswith("fp32 instead of bf16: the verification pass")
    assert "2.00e-02" in plan.overrides["m1"].reason and "1.00e-02" in plan.overrides["m1"].reason
    assert mc.loss_rel_change == 0.005 and mc.repairs == ["m0: bf16 -> fp32", "m1: bf16 -> fp32"]
