"""The plan returned: the mixed plan only when it is measured within budget and estimated faster than every
uniform format that is (docs/plan.md).

The uniform candidates are the all-format passes the audit already ran: a format is one when its pass is within
budget at both reduction orders (capture/noise.py) and no module's values overflow it (rules.refusal). FP32 is
always one (the reference itself). Every candidate's estimated step time is computed the same way — the cost model's
per-module time in the format the plan gives that module, summed over every module with a cost of its own
(:func:`plan_step_time`), which for a uniform plan is exactly the all-format estimate of analysis/performance.py.
The mixed plan is verified (one forward with the policy applied, at both reduction orders) only when its estimate
beats the best uniform candidate, and repaired while it breaks the budget. Between equal estimated times the plan
with fewer overrides wins, then the one without loss scaling, then the preference order of planner.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..formats import Format
from .planner import FORMAT_PREFERENCE
from .rules import LayerPlan, Plan

MAX_REPAIRS = 4
# Estimated times closer than this (relative) are equal: the sums of the same per-module figures in another
# order may differ in the last bits.
TIME_TIE = 1e-9


@dataclass
class PlanCandidate:
    label: str  # "uniform bf16", "mixed", "uniform fp32"
    plan: Plan
    estimated_step_time_s: float | None
    loss_rel_change: float | None = None  # upper end over the reduction orders measured
    loss: float | None = None  # the loss with the plan applied (this audit's own order)
    loss_rel_change_range: tuple[float, float] | None = None
    output_rel_error: float | None = None
    within_budget: bool | None = None  # None: not verified
    passes: int = 0  # verification passes this candidate cost (uniform ones: 0, measured by the audit already)
    repairs: list[str] = field(default_factory=list)
    note: str = ""
    error: str | None = None

    @property
    def loss_scaling(self) -> bool:
        p = self.plan
        return p.default_format is Format.FP16 or any(o.format is Format.FP16 for o in p.overrides.values())

    def key(self, best_time: float) -> tuple:
        t = self.estimated_step_time_s if self.estimated_step_time_s is not None else math.inf
        tied = abs(t - best_time) <= TIME_TIE * max(abs(best_time), 1e-30)
        order = FORMAT_PREFERENCE.index(self.plan.default_format) if self.plan.default_format in FORMAT_PREFERENCE \
            else len(FORMAT_PREFERENCE)
        return (best_time if tied else t, len(self.plan.overrides), self.loss_scaling, order)

    def to_dict(self, chosen: bool) -> dict[str, Any]:
        return {"label": self.label, "chosen": chosen, "default_format": self.plan.default_format.value,
                "overrides": len(self.plan.overrides), "loss_scaling": self.loss_scaling,
                "estimated_step_time_s": self.estimated_step_time_s, "loss_rel_change": self.loss_rel_change,
                "loss_rel_change_range": list(self.loss_rel_change_range) if self.loss_rel_change_range else None,
                "output_rel_error": self.output_rel_error, "within_budget": self.within_budget,
                "verification_passes": self.passes, "repairs": list(self.repairs), "note": self.note,
                "error": self.error}


def plan_step_time(plan: Plan, perf) -> float:
    """Estimated step time of ``plan`` on the target: each module's own cost in the format the plan gives it.

    The same sum, over the same modules in the same order, as analysis/performance.py's all-format totals (and the
    ops outside every module, the loss, in the default format), so a plan with no overrides gets exactly the
    estimate of its default format.
    """
    total = 0.0
    for name, lp in perf.layers.items():
        if lp.cost is None:
            continue
        times = lp.cost.estimated_step_time_s
        layer = plan.layers.get(name)
        f = (layer.format if layer is not None else plan.default_format).value
        total += times.get(f, times.get("fp32", 0.0))
    outside = getattr(perf, "outside_step_time_s", {})
    return total + outside.get(plan.default_format.value, outside.get("fp32", 0.0))


def uniform_plan(analysis, fmt: Format, why: str, labels: dict[str, str] | None = None) -> Plan:
    """Every module in ``fmt``; ``labels``: modules whose output gradient is zero, with why (rules.zero_gradient)."""
    plan = Plan(default_format=fmt, default_reason=why, source="uniform")
    for L in analysis.layers:
        z = (labels or {}).get(L.name)
        plan.layers[L.name] = LayerPlan(fmt, f"{z}: its format cannot change the loss; default format" if z
                                        else f"uniform {fmt}: every module in the default format")
    return plan


def uniform_candidates(analysis, perf, formats: tuple[Format, ...], refusals: dict[Format, list[str]],
                       labels: dict[str, str] | None = None) -> list[PlanCandidate]:
    """FP32, and each audited format whose own pass is within budget and that no module's values overflow."""
    budget = analysis.budget
    p32 = uniform_plan(analysis, Format.FP32, "the FP32 reference: no low-precision plan is within budget and faster",
                       labels)
    out = [PlanCandidate("uniform fp32", p32, plan_step_time(p32, perf), 0.0, analysis.reference_loss, None, 0.0, True,
                         note="the FP32 reference itself")]
    for f in formats:
        s = analysis.summaries.get(f)
        if s is None:
            continue
        lc_range = s.loss_rel_change_range
        oe_range = s.output_rel_error_range
        lc = lc_range[1] if lc_range else s.loss_rel_change
        oe = oe_range[1] if oe_range else (s.output.rel_l2 if s.output else None)
        refused = refusals.get(f) or []
        note = s.verdict
        ok = s.safe and not refused
        if s.safe and refused:
            note = (f"measured within budget, but {len(refused)} module(s) overflow {f} "
                    f"({', '.join(n or '(model)' for n in refused[:3])}{' ...' if len(refused) > 3 else ''})")
        up = uniform_plan(analysis, f, f"every module in {f}: its own pass is within budget (loss change {_fig(lc)}, "
                                       f"budget {budget.max_loss_rel_change:.2e})", labels)
        out.append(PlanCandidate(f"uniform {f}", up, plan_step_time(up, perf), lc, s.loss, lc_range, oe, ok,
                                 note=note))
    return out


def _fig(x: float | None) -> str:
    return "not measured" if x is None else f"{x:.2e}"


def choose(analysis, perf, formats: tuple[Format, ...], mixed: Plan, planner_result, verify: Callable,
           make_policy: Callable[[Plan], Any], impact_of: Callable[[str, Format], float],
           say: Callable[[str], None]) -> tuple[PlanCandidate, list[PlanCandidate]]:
    """Weigh the mixed plan against the uniform candidates; returns (the chosen one, every candidate).

    ``verify(policy, default) -> (loss_rel_changes, output_rel_errors, error, loss)``: one forward per reduction order;
    ``impact_of(module, format)``: the calibrated estimated loss impact, to pick what a repair moves first.
    """
    uniforms = uniform_candidates(analysis, perf, formats, mixed.refusals, mixed.zero_gradient)
    ok = [c for c in uniforms if c.within_budget]
    best_t = min(c.estimated_step_time_s for c in ok if c.estimated_step_time_s is not None)
    best = min(ok, key=lambda c: c.key(best_t))
    best_time = best.estimated_step_time_s if best.estimated_step_time_s is not None else math.inf
    cands = list(uniforms)
    same_as_uniform = not mixed.overrides and any(c.plan.default_format is mixed.default_format for c in ok)
    if same_as_uniform:
        return best, cands
    mc = PlanCandidate("mixed", mixed, plan_step_time(mixed, perf))
    cands.append(mc)
    if mc.estimated_step_time_s is None or not mc.estimated_step_time_s < best_time * (1 - TIME_TIE):
        mc.note = (f"not verified: estimated {_us(mc.estimated_step_time_s)} per step, no faster than "
                   f"{best.label} ({_us(best.estimated_step_time_s)})")
        return best, cands
    say("verifying the mixed plan (one forward per reduction order with the policy applied)")
    _verify_and_repair(analysis, mc, planner_result, verify, make_policy, impact_of)
    mc.estimated_step_time_s = plan_step_time(mixed, perf)
    say(f"mixed plan verified: loss change {_fig(mc.loss_rel_change)}, output error {_fig(mc.output_rel_error)}"
        + ("" if mc.within_budget else " (budget still broken)")
        + (f"; {len(mc.repairs)} repair(s)" if mc.repairs else ""))
    if not mc.within_budget:
        mc.note = f"over budget after {len(mc.repairs)} repair(s): {best.label} is returned"
        return best, cands
    if not mc.estimated_step_time_s < best_time * (1 - TIME_TIE):
        mc.note = (f"within budget, but after its repairs estimated {_us(mc.estimated_step_time_s)} per step, no "
                   f"faster than {best.label} ({_us(best.estimated_step_time_s)})")
        return best, cands
    mc.note = (f"within budget and estimated {_us(mc.estimated_step_time_s)} per step against "
               f"{_us(best.estimated_step_time_s)} for {best.label}, the fastest uniform format within budget")
    return mc, cands


def _us(t: float | None) -> str:
    return "not estimated" if t is None else f"{t * 1e6:.4g} us"


def _verify_and_repair(analysis, mc: PlanCandidate, result, verify, make_policy, impact_of) -> None:
    """Verify; while the budget breaks, move the modules with the largest estimated loss change to fp32 (one, then
    half of the rest), each with a reason that quotes the verification's figures and the budget."""
    budget = analysis.budget
    plan = mc.plan
    default = plan.default_format if plan.default_format in (Format.FP16, Format.BF16) else None

    def check() -> bool:
        mc.passes += 1
        lcs, oes, err, mc.loss = verify(make_policy(plan), default)
        mc.error = err
        good_l = [x for x in lcs if x is not None and math.isfinite(x)]
        good_o = [x for x in oes if x is not None and math.isfinite(x)]
        mc.loss_rel_change = max(good_l) if len(good_l) == len(lcs) and lcs else math.inf
        mc.loss_rel_change_range = (min(good_l), max(good_l)) if len(good_l) == len(lcs) and lcs else None
        mc.output_rel_error = max(good_o) if len(good_o) == len(oes) and oes else math.inf
        mc.within_budget = (err is None and mc.loss_rel_change <= budget.max_loss_rel_change
                            and mc.output_rel_error <= budget.max_output_rel_error)
        return mc.within_budget

    ok = check()
    low = [(n, lp.format) for n, lp in plan.layers.items() if result is not None and n in result.decisions
           and lp.format is not Format.FP32]
    remaining: list[tuple[str, Format]] = sorted(low, key=lambda x: (-impact_of(x[0], x[1]), x[0]))
    ref = abs(analysis.reference_loss) or 1.0
    rounds = 0
    batch: list[tuple[str, Format]] = []

    def pin(items: list[tuple[str, Format]]) -> None:
        for n, f in items:
            for child in list(plan.layers):
                if child.startswith(n + ".") and child not in plan.overrides:
                    plan.layers[child] = LayerPlan(Format.FP32, "inside a module planned as fp32")
            reason = (f"fp32 instead of {f}: the verification pass with the plan applied measured loss change "
                      f"{_fig(mc.loss_rel_change)} and output error {_fig(mc.output_rel_error)} against the budget "
                      f"{budget.max_loss_rel_change:.2e} / {budget.max_output_rel_error:.2e}; it was the module left "
                      f"in "
                      f"{f} with the largest estimated loss change ({impact_of(n, f) / ref:.2e})")
            plan.overrides[n] = LayerPlan(Format.FP32, reason)
            plan.layers[n] = plan.overrides[n]
            mc.repairs.append(f"{n}: {f} -> fp32")

    def state() -> tuple:
        return (dict(plan.layers), dict(plan.overrides), list(mc.repairs), mc.loss_rel_change,
                mc.loss_rel_change_range, mc.output_rel_error, mc.within_budget, mc.loss, mc.error)

    def restore(st: tuple) -> None:
        plan.layers.clear()
        plan.layers.update(st[0])
        plan.overrides.clear()
        plan.overrides.update(st[1])
        (mc.repairs[:], mc.loss_rel_change, mc.loss_rel_change_range, mc.output_rel_error, mc.within_budget,
         mc.loss, mc.error) = st[2:]

    while not ok and remaining and rounds < MAX_REPAIRS:
        take = 1 if not rounds else max(1, len(remaining) // 2)
        batch, remaining = remaining[:take], remaining[take:]
        rounds += 1
        before = state()
        pin(batch)
        ok = check()
    # Give back what the last repair did not need: its smaller-impact half goes back to its format while the
    # budget still holds (at most MAX_REPAIRS more passes).
    if ok and len(batch) > 1:
        keep, tries = batch, 0
        while len(keep) > 1 and tries < MAX_REPAIRS:
            tries += 1
            good = state()
            restore(before)
            head = keep[:len(keep) // 2]
            pin(head)
            if check():
                keep = head
            else:
                restore(good)
                break


def _impact_sum_rel(plan: Plan, result, ref: float, calibrated: bool) -> float | None:
    """Each planned low-precision module's measured first-order impact in the format the plan gives it, summed
    (times that format's calibration factor when ``calibrated``), relative to the loss. None without a planner
    result, or when a module's impact in its planned format was not measured."""
    if result is None:
        return None
    total = 0.0
    for n, raw in result.raw_impacts.items():
        lp = plan.layers.get(n)
        f = lp.format if lp is not None else plan.default_format
        if f in (Format.FP32, Format.TF32):
            continue
        v = raw.get(f)
        if v is None:
            return None
        total += v * (result.calibration.get(f, 1.0) if calibrated else 1.0)
    return total / (abs(ref) or 1.0)


def predicted_rel(plan: Plan, result, ref: float) -> float | None:
    """The calibrated first-order loss change of ``plan`` (relative)."""
    return _impact_sum_rel(plan, result, ref, calibrated=True)


def first_order_rel(plan: Plan, result, ref: float) -> float | None:
    """The same sum without calibration: the triangle-inequality bound of the plan's loss change."""
    return _impact_sum_rel(plan, result, ref, calibrated=False)


AGREEMENT = 2.0  # predicted and verified loss changes "agree" within this factor (issue 12)


def prediction_note(predicted: float | None, verified: float | None, floor: float) -> dict[str, Any]:
    """How the plan's prediction compares with its verification, and which of the two it trusts."""
    if predicted is None or verified is None or not math.isfinite(verified):
        return {"ratio": None, "agree": None, "trusted": "verified" if verified is not None else "predicted",
                "note": "no prediction to compare" if predicted is None else "the verification has no finite figure"}
    lo = max(min(predicted, verified), floor)
    hi = max(predicted, verified, floor)
    ratio = hi / lo if lo > 0 else (1.0 if hi == 0 else math.inf)
    agree = ratio <= AGREEMENT
    note = (f"predicted and verified agree within {AGREEMENT:g}x" if agree else
            f"predicted {predicted:.2e} and verified {verified:.2e} differ by {ratio:.3g}x: the plan trusts the "
            "verification, a measurement of this very plan; the first-order figures only rank the modules")
    return {"ratio": ratio, "agree": agree, "trusted": "verified", "note": note}
