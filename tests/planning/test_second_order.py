"""The second reduction order only where it can change a decision (issue 33; docs/plan.md, "Noise floor").

The FP32 noise floor always runs; a format's forward at the second order only for a verdict whose figures lie within
the margin below the budget; the planner's impacts there (the reference pass repeated) only when its choices can
depend on them; a verification pass at the second order only near the budget. The guarantee of issue 12 holds: the
same decisions at 1 and at 2 threads, shown here on a model whose FP32 sums move with the thread count on any CPU.
"""

from __future__ import annotations

import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT
from precision_audit.analysis.findings import Budget
from precision_audit.audit import AuditOptions, compute_audit
from precision_audit.capture import noise as noise_mod
from precision_audit.capture.noise import NOT_NEEDED, NoiseFloor, OrderRun
from precision_audit.formats import Format
from precision_audit.planning import second_order
from precision_audit.planning.second_order import (
    MARGINS,
    Decided,
    near,
    plan_with_orders,
    planner_recheck,
    weigh,
)
from precision_audit.planning.verified import plan_verifier

MLP = ROOT / "sample_models" / "mlp"

# Another reduction order, on any CPU: at one thread the input is scaled by 1 + 2^-14 before the first GEMM (the
# size of the FP32 differences the thread count makes on ResNet-50's later layers, docs/plan.md), so the format
# passes round other values there and every low-precision figure moves a little with the thread count.
ORDERED = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.fc2 = nn.Linear(256, 256)
        self.head = nn.Linear(256, 16)

    def forward(self, x):
        if torch.get_num_threads() == 1:
            x = x * (1 + 2 ** -14)
        return self.head(torch.tanh(self.fc2(torch.relu(self.fc1(x)))))


def build_model():
    torch.manual_seed(0)
    return Net()


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 64, generator=g), torch.randint(0, 16, (32,), generator=g)
'''


# --- the rule ---------------------------------------------------------------------------------------------------


def test_a_figure_is_near_only_within_its_margin_below_its_threshold():
    t = 1e-2
    for name, m in (("loss_rel_change", 10.0), ("output_rel_error", 2.0)):
        assert MARGINS[name] == m
        assert not near(t / m, t, name)  # exactly the margin below: the other order cannot carry it over
        assert near(t / m * (1 + 1e-9), t, name) and near(t, t, name)
        assert not near(t * (1 + 1e-9), t, name)  # over: over whatever the other order gives
        assert not near(None, t, name) and not near(math.inf, t, name) and not near(math.nan, t, name)


def test_weighing_a_decision():
    far = weigh("d", {"loss_rel_change": (1e-4, 1e-2), "output_rel_error": (1e-3, 5e-2)})
    assert not far.rechecked
    assert far.reason == ("loss_rel_change 100x below (margin 10x), output_rel_error 50x below (margin 2x): the other "
                          "order cannot carry them over")
    close = weigh("d", {"loss_rel_change": (1e-4, 1e-2), "output_rel_error": (3e-2, 5e-2)})
    assert close.rechecked and close.reason.startswith("output_rel_error 0.03 is within 2x below its threshold")
    # one figure over its threshold decides it, even with the other near: no re-check
    over = weigh("d", {"loss_rel_change": (5e-3, 1e-2), "output_rel_error": (6e-2, 5e-2)})
    assert not over.rechecked and "over its threshold" in over.reason and "output_rel_error 0.06 > 0.05" in over.reason
    assert not weigh("d", {"loss_rel_change": (None, 1e-2)}).rechecked
    zero = weigh("d", {"loss_rel_change": (0.0, 1e-2), "output_rel_error": (0.0, 5e-2)})  # changes nothing
    assert not zero.rechecked and zero.reason.startswith("loss_rel_change 0 (margin 10x)")
    taken = weigh("d", {"loss_rel_change": (5e-3, 1e-2)}, already="the pass raised")
    assert not taken.rechecked and taken.reason == "the pass raised"
    assert taken.to_dict()["figures"] == {"loss_rel_change": {"value": 5e-3, "threshold": 1e-2}}
    # a loss change cancelled at this order (1e-4) whose first-order sum (3e-3) says the other order could reach
    # the budget: re-checked; the gauge never decides "over" by itself
    gauged = weigh("d", {"loss_rel_change": (1e-4, 1e-2)}, gauges={"first_order_sum_rel": (3e-3, 1e-2)})
    assert gauged.rechecked and gauged.reason.startswith("first_order_sum_rel 0.003 is within 10x below")
    high = weigh("d", {"loss_rel_change": (1e-4, 1e-2)}, gauges={"first_order_sum_rel": (5e-2, 1e-2)})
    assert high.rechecked and "(or over it)" in high.reason
    quiet = weigh("d", {"loss_rel_change": (1e-4, 1e-2)}, gauges={"first_order_sum_rel": (5e-4, 1e-2)})
    assert not quiet.rechecked and set(quiet.figures) == {"loss_rel_change", "first_order_sum_rel"}


def _planner_case(measured: float, note: str | None = None, rechecked: bool = False, raw: float = 0.0,
                  promotions: tuple = (), gauge: float | None = None):
    """An analysis and a planner result whose first choice runs two modules in bf16 (hand-made figures)."""
    decisions = {n: SimpleNamespace(first=Format.BF16) for n in ("a", "b")}
    decisions["c"] = SimpleNamespace(first=Format.FP32)
    result = SimpleNamespace(decisions=decisions, promotions=list(promotions), loss_budget=1e-2 * 2.0,
                             calibration_info={"bf16": {"measured_loss_rel_change": measured, "note": note,
                                                        "first_order_sum_rel": gauge}},
                             raw_impacts={"a": {Format.BF16: raw}, "b": {Format.BF16: raw},
                                          "c": {Format.BF16: 1.0}})
    runs = {Format.BF16: OrderRun(loss=2.0 * (1 + measured), output_rel_error=1e-3)} if rechecked else {}
    noise = NoiseFloor(method="t", threads=(2, 1), reference_loss=2.0, loss_rel=0.0, output_rel_error=0.0, runs=runs)
    analysis = SimpleNamespace(budget=Budget(max_loss_rel_change=1e-2), reference_loss=2.0, noise=noise)
    return analysis, result


def test_the_planner_needs_the_second_order_only_when_its_first_choice_could_go_over_the_budget():
    bound = "predicted_loss_rel_change_bound"
    # calibrated, measured at one order only: the loss margin times the larger of the figure and its first-order sum
    a, r = _planner_case(5e-4)
    check = planner_recheck(a, r)
    assert not check.rechecked and check.figures[bound] == (pytest.approx(5e-3), 1e-2)
    assert planner_recheck(*_planner_case(2e-3)).rechecked  # 2e-2 > 1e-2: a repair could run at the other order
    assert planner_recheck(*_planner_case(5e-4, gauge=2e-3)).rechecked
    assert not planner_recheck(*_planner_case(5e-4, gauge=8e-4)).rechecked
    # measured at both orders: the upper end itself is the bound
    assert not planner_recheck(*_planner_case(9e-3, rechecked=True, gauge=5e-2)).rechecked
    # not calibrated (factor 1): the margin times the raw first-order sum of the first choice's modules (a and b;
    # c stays in fp32), relative to the planner's reference loss 2.0
    a, r = _planner_case(1e-5, note="not calibrated: within the FP32 noise floor", raw=4e-4)
    assert planner_recheck(a, r).figures[bound][0] == pytest.approx(10 * 8e-4 / 2)
    assert not planner_recheck(a, r).rechecked
    assert planner_recheck(*_planner_case(1e-5, note="not calibrated", raw=1.2e-3)).rechecked
    # a repair that ran needs the impacts' values whatever the bound
    assert planner_recheck(*_planner_case(1e-5, promotions=("a: bf16 -> fp32",))).rechecked


def test_a_verification_pass_runs_at_the_second_order_only_near_the_budget(monkeypatch):
    calls = []
    monkeypatch.setattr(noise_mod, "plan_forward",
                        lambda *a: calls.append(a) or OrderRun(loss=1.0, output_rel_error=0.0))
    out = SimpleNamespace(rel_l2=1e-3)
    losses = iter([1.0001, 1.003, 1.02])  # loss changes 1e-4 (far), 3e-3 (near), 2e-2 (over)
    session = SimpleNamespace(verify_plan=lambda p, d: SimpleNamespace(loss=next(losses), output=out, error=None))
    nf = NoiseFloor(method="t", threads=(2, 1), reference_loss=1.0, loss_rel=0.0, output_rel_error=0.0)
    rechecks: list = []
    gauges = iter([1e-4, 1e-4, 1e-4, 5e-3, math.inf])  # the plan's first-order sum, per pass
    verify = plan_verifier(session, nf, 1.0, Budget(max_loss_rel_change=1e-2), rechecks, lambda p: next(gauges))
    runs = [len(verify(None, Format.BF16)[0]) for _ in range(3)]
    assert runs == [1, 2, 1] and len(calls) == 1
    assert [r.rechecked for r in rechecks] == [False, True, False]
    assert rechecks[1].decision == "the mixed plan's verification, pass 2"
    # a loss change far below the budget whose plan's first-order sum is not (or is not known): re-checked, as a
    # loss change can nearly cancel at one order (docs/plan.md)
    losses = iter([1.0001, 1.0001])
    assert [len(verify(None, Format.BF16)[0]) for _ in range(2)] == [2, 2]
    assert rechecks[-1].reason == "first_order_sum_rel not measured: re-measured at the second order"
    # without a budget (the old contract): both orders every time
    losses = iter([1.0001])
    assert len(plan_verifier(session, nf, 1.0)(None, Format.BF16)[0]) == 2


def test_a_failed_verification_measures_the_impacts_and_plans_again():
    """Repairs rank modules by their impacts: with one order's impacts, the plan is made and verified again with
    both (as an audit that had them from the start would have)."""
    nf = NoiseFloor(method="t", threads=(2, 1), reference_loss=1.0, loss_rel=0.0, output_rel_error=0.0,
                    impacts_note=NOT_NEEDED)
    log: list[str] = []
    capture = SimpleNamespace()

    def plan(analysis):
        log.append("plan")
        return "mixed", SimpleNamespace(promotions=[], decisions={}, loss_budget=1e-2, calibration_info={},
                                        raw_impacts={})

    def complete():
        log.append("complete")
        nf.impacts = {}

    def choose(d, rechecks):
        log.append("choose")
        failed = nf.impacts is None
        mixed = SimpleNamespace(label="mixed", passes=1, repairs=["m: bf16 -> fp32"] if failed else [],
                                within_budget=True)
        return SimpleNamespace(candidates=[mixed])

    analysis = SimpleNamespace(summaries={}, noise=nf, budget=Budget(), reference_loss=1.0)
    real_analyse = second_order.analyse
    second_order.analyse = lambda c, b, n: analysis
    try:
        decided, chosen = plan_with_orders(capture, nf, Budget(), plan, lambda f: log.append("recheck"), complete,
                                           choose)
    finally:
        second_order.analyse = real_analyse
    assert log == ["plan", "choose", "complete", "plan", "choose"]
    assert isinstance(decided, Decided) and chosen.candidates[0].repairs == []
    planner = next(r for r in nf.rechecks if r["decision"] == second_order.PLANNER)
    assert planner["rechecked"] and "verification came out over budget" in planner["reason"]


# --- whole audits ------------------------------------------------------------------------------------------------


def _audit(model: str, **kw) -> dict:
    return compute_audit(AuditOptions(model=model, steps=0, **kw)).audit


def _counting(monkeypatch) -> dict[str, int]:
    counts = {"fp32": 0, "impacts": 0, "formats": 0}
    real_run, real_impacts, real_format = (noise_mod._Fp32Order.run, noise_mod.second_order_impacts,
                                           noise_mod._format_forward)

    def run(self):
        counts["fp32"] += 1
        real_run(self)

    def impacts(*a, **k):
        counts["impacts"] += 1
        return real_impacts(*a, **k)

    def forward(*a, **k):
        counts["formats"] += 1
        return real_format(*a, **k)

    monkeypatch.setattr(noise_mod._Fp32Order, "run", run)
    monkeypatch.setattr(noise_mod, "second_order_impacts", impacts)
    monkeypatch.setattr(noise_mod, "_format_forward", forward)
    return counts


def test_far_from_every_threshold_only_the_fp32_noise_floor_runs(monkeypatch):
    from precision_audit.audit import result_of

    counts = _counting(monkeypatch)
    c = compute_audit(AuditOptions(model=str(MLP / "model.py"), batch=str(MLP / "sample.pt"), steps=0))
    a = c.audit
    nf = a["noise_floor"]
    assert counts == {"fp32": 1, "impacts": 0, "formats": 0}
    assert nf["second_order"] == {} and nf["planner_impacts"] == NOT_NEEDED and nf["margins"] == MARGINS
    assert nf["fp32_loss_rel"] is not None and nf["threads"] is not None
    assert [r["rechecked"] for r in nf["rechecks"]] == [False, False, False]
    assert [r["decision"].split(":")[0] for r in nf["rechecks"][:2]] == ["fp16", "bf16"]
    assert a["summary"]["bf16"]["safe"] and a["plan"]["chosen"] == "uniform bf16"
    # the report says which decisions were weighed, and why none needed the second order
    html = result_of(c).to_html()
    assert 'id="rechecks"' in html and html.count("<strong>not re-checked</strong>") == 3
    assert "the other order cannot carry them over" in html and "loss_rel_change 10x, output_rel_error 2x" in html


def test_a_verdict_near_its_budget_is_re_measured_at_the_second_order(monkeypatch):
    """The MLP's bf16 loss change (1.9e-4) is within 10x below a 5e-4 budget, fp16's (1.2e-5, first-order sum 5e-6)
    is not: one forward at the second order, bf16's; the planner's first choice (bf16) is then bounded by that
    measured upper end."""
    counts = _counting(monkeypatch)
    a = _audit(str(MLP / "model.py"), batch=str(MLP / "sample.pt"), budget=Budget(max_loss_rel_change=5e-4))
    nf = a["noise_floor"]
    assert counts == {"fp32": 1, "impacts": 0, "formats": 1}
    assert set(nf["second_order"]) == {"bf16"}
    by = {r["decision"].split(":")[0]: r for r in nf["rechecks"]}
    assert by["bf16"]["rechecked"] and not by["fp16"]["rechecked"]
    assert not nf["rechecks"][-1]["rechecked"]  # the planner
    lc = a["summary"]["bf16"]["loss_rel_change"]
    assert nf["rechecks"][-1]["figures"]["predicted_loss_rel_change_bound"]["value"] == pytest.approx(
        max(lc, nf["second_order"]["bf16"]["loss_rel_change"]))


def _at(threads: int, model: str, budget: Budget) -> dict:
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _audit(model, formats=(Format.BF16,), budget=budget)
    finally:
        torch.set_num_threads(old)


def _decisions(a: dict) -> dict:
    return {"safe": a["summary"]["bf16"]["safe"], "verdict": a["verdict"], "chosen": a["plan"]["chosen"],
            "default": a["plan"]["default_format"],
            "overrides": {n: o["format"] for n, o in a["plan"]["overrides"].items()},
            "layers": {L["name"]: L["plan"]["format"] for L in a["layers"]}}


def test_a_threshold_between_the_two_orders_gives_the_same_decisions_at_1_and_2_threads(tmp_path, monkeypatch):
    p = tmp_path / "model.py"
    p.write_text(textwrap.dedent(ORDERED))
    loose = Budget(max_loss_rel_change=1.0, max_output_rel_error=1.0)
    e2 = _at(2, str(p), loose)["summary"]["bf16"]["output"]["rel_l2"]  # each order's figure, as its own audit's
    e1 = _at(1, str(p), loose)["summary"]["bf16"]["output"]["rel_l2"]
    assert e1 != e2 and max(e1, e2) < MARGINS["output_rel_error"] * min(e1, e2), (e1, e2)  # differ, within margin
    budget = Budget(max_loss_rel_change=1.0, max_output_rel_error=(e1 + e2) / 2)  # between them
    two, one = _at(2, str(p), budget), _at(1, str(p), budget)
    assert _decisions(two) == _decisions(one)
    assert not two["summary"]["bf16"]["safe"]  # the upper end is over the budget, whichever order is the audit's
    # the audit whose own order measured under the budget re-checked it; the other was over it already
    below, above = (two, one) if e2 < e1 else (one, two)
    assert below["noise_floor"]["rechecks"][0]["rechecked"] and "bf16" in below["noise_floor"]["second_order"]
    assert not above["noise_floor"]["rechecks"][0]["rechecked"]
    assert "over its threshold at the audit's own order" in above["noise_floor"]["rechecks"][0]["reason"]
    # without the re-check (no margin: every figure taken at the audit's own order) the thread count decides
    monkeypatch.setitem(second_order.MARGINS, "output_rel_error", 1.0)
    monkeypatch.setitem(second_order.MARGINS, "loss_rel_change", 1.0)
    assert _decisions(_at(2, str(p), budget))["safe"] != _decisions(_at(1, str(p), budget))["safe"]
