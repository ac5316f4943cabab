"""The second reduction order only where it can change a decision (docs/plan.md, "Noise floor").

On a CPU the same FP32 model sums its GEMMs in another order at 1 and at 2 threads, and every figure moves with it.
A decision (a format's verdict, the planner's choices, a plan's verification) rests on the upper end of what the two
orders measure, so that an audit at 1 thread and one at 2 threads decide alike (issue 12). The FP32 noise floor (one
FP32 forward at the second order) always runs; the rest is re-measured there only for the decisions whose figures at
the audit's own order lie within a margin below their threshold (:data:`MARGINS`):

- above the threshold the decision is already "over budget", whatever the other order gives (the upper end is at
  least this figure);
- further below it than the margin, the other order cannot carry the figure over it (docs/plan.md: an output error
  moved by at most 1.4x between the orders on real models; a loss change, the difference of two scalars, can nearly
  cancel at one order, so it is also judged by the sum of its modules' |first-order impacts|, which does not).

:func:`decide` runs the analysis and the planner, re-checks what they need, and returns them with every decision
weighed (:class:`Recheck`, audit.json's ``noise_floor.rechecks``); :func:`verification_rechecked` is the same rule
for the plan's verification (planning/verified.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..analysis.findings import Analysis, Budget, analyse
from ..formats import Format

#: A figure (and a gauge of a loss change: the first-order sum) at least this many times below its threshold is not
#: re-measured at the second order (docs/plan.md, "Noise floor", which says why these two).
MARGINS = {"loss_rel_change": 10.0, "output_rel_error": 2.0}
LOSS = "loss_rel_change"
GAUGE = "first_order_sum_rel"  # the format's sum of |first-order loss impacts|, relative (plan.calibration)


def margin(name: str) -> float:
    """The margin of a figure: the output error's for an output error, the loss change's for anything derived from a
    loss change."""
    return MARGINS["output_rel_error"] if name == "output_rel_error" else MARGINS[LOSS]


@dataclass
class Recheck:
    """One decision weighed for the second order: its figures at the audit's own order against their thresholds."""

    decision: str
    figures: dict[str, tuple[float | None, float]]  # name -> (the audit's own order's figure, its threshold)
    rechecked: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "rechecked": self.rechecked, "reason": self.reason,
                "figures": {k: {"value": _finite(v), "threshold": t} for k, (v, t) in self.figures.items()}}


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def near(value: float | None, threshold: float, name: str = LOSS) -> bool:
    """Within the margin below ``threshold`` (the other order could carry it over), and not above it."""
    return value is not None and math.isfinite(value) and threshold / margin(name) < value <= threshold


def _over(value: float | None, threshold: float) -> bool:
    return value is None or not math.isfinite(value) or value > threshold


def weigh(decision: str, figures: dict[str, tuple[float | None, float]], already: str | None = None,
          gauges: dict[str, tuple[float | None, float]] | None = None) -> Recheck:
    """Whether the figures of one decision need the second order: any of them near its threshold while none is over
    (``already``: the decision is taken on something the order does not move, e.g. a pass that raised). A gauge
    (``gauges``: a figure that bounds one of them at either order, e.g. a loss change's first-order sum) only asks
    for the re-check: above its figure's margin below the threshold, or not known, the other order could reach
    it."""
    both = {**figures, **(gauges or {})}
    if already:
        return Recheck(decision, both, False, already)
    over = [k for k, (v, t) in figures.items() if _over(v, t)]
    if over:
        v, t = figures[over[0]]
        fig = "not finite" if v is None or not math.isfinite(v) else f"{v:.3g} > {t:.3g}"
        return Recheck(decision, both, False, f"over its threshold at the audit's own order ({over[0]} {fig}): "
                                              "over whatever the second order measures")
    close = [k for k, (v, t) in figures.items() if near(v, t, k)]
    close += [k for k, (v, t) in (gauges or {}).items() if v is None or not math.isfinite(v) or v > t / margin(k)]
    if close:
        v, t = both[close[0]]
        if v is None or not math.isfinite(v):
            return Recheck(decision, both, True, f"{close[0]} not measured: re-measured at the second order")
        return Recheck(decision, both, True, f"{close[0]} {v:.3g} is within {margin(close[0]):g}x below its "
                                             f"threshold {t:.3g}{' (or over it)' if v > t else ''}"
                                             ": re-measured at the second order")
    parts = [f"{k} {'0' if not v else f'{t / v:.3g}x below'} (margin {margin(k):g}x)"
             for k, (v, t) in both.items() if v is not None]
    return Recheck(decision, both, False, f"{', '.join(parts)}: the other order cannot carry them over")


def verdict_recheck(analysis: Analysis, fmt: Format, first_order_sum: float | None = None) -> Recheck:
    """The re-check of ``fmt``'s verdict (and of the uniform ``fmt`` plan, which is that verdict); ``first_order_sum``:
    the sum of the format's |first-order loss impacts| relative to the loss (the planner's, plan.calibration), the
    gauge of its loss change."""
    s = analysis.summaries[fmt]
    b = analysis.budget
    figures = {LOSS: (s.loss_rel_change, b.max_loss_rel_change),
               "output_rel_error": (s.output.rel_l2 if s.output else None, b.max_output_rel_error)}
    already = None
    if s.error:
        already = "the pass raised: not measured at either order"
    elif s.param_grads_nonfinite:
        already = (f"{s.param_grads_nonfinite} non-finite parameter gradient element(s) at the audit's own order: "
                   "unsafe whatever the second order measures")
    gauges: dict[str, tuple[float | None, float]] | None = \
        {GAUGE: (first_order_sum, b.max_loss_rel_change)} if first_order_sum is not None else None
    return weigh(f"{fmt}: safe as is (its verdict, and the uniform {fmt} plan)", figures, already, gauges)


@dataclass
class Decided:
    """The analysis and the planner's result, with the second order measured where they need it."""

    analysis: Analysis
    mixed: Any  # rules.Plan
    planner_result: Any  # planner.PlannerResult | None
    rechecks: list[Recheck] = field(default_factory=list)


def decide(capture, noise, budget: Budget, plan: Callable[[Analysis], tuple[Any, Any]],
           recheck: Callable[[tuple[Format, ...]], None], complete: Callable[[], None]) -> Decided:
    """Analyse and plan (``plan(analysis) -> (mixed plan, planner result)``), re-measuring at the second order what a
    decision needs: ``recheck(formats)`` runs those formats' forwards there, ``complete()`` everything else there
    (the planner's impacts; capture/noise.py). ``noise`` is the FP32 noise floor (None when no format ran)."""
    analysis = analyse(capture, budget, noise)
    if noise is None:
        mixed, result = plan(analysis)
        return Decided(analysis, mixed, result)
    mixed, result = plan(analysis)  # the planner's first-order sums are the gauges of the loss changes
    verdicts = {f: verdict_recheck(analysis, f, _first_order_sum(result, f)) for f in analysis.summaries}
    todo = tuple(f for f, r in verdicts.items() if r.rechecked)
    if todo:
        recheck(todo)
        analysis = analyse(capture, budget, noise)
        mixed, result = plan(analysis)
    planner = planner_recheck(analysis, result)
    # a bound over the budget only for want of a format's figure at the second order: that forward first (cheap)
    extra = tuple(f for f in _first_formats(result) if f in verdicts and f not in noise.runs) \
        if planner.rechecked and result is not None and not result.promotions else ()
    if extra:
        recheck(extra)
        for f in extra:
            v = verdicts[f]
            verdicts[f] = Recheck(v.decision, v.figures, True, v.reason + "; re-measured all the same: the planner's "
                                                                         "first choice runs modules in it")
        analysis = analyse(capture, budget, noise)
        mixed, result = plan(analysis)
        planner = planner_recheck(analysis, result)
    if planner.rechecked and noise.threads is None:
        planner = Recheck(planner.decision, planner.figures, False, "on CUDA the thread count does not change a "
                                                                    "kernel's reduction order: one order's impacts")
    elif planner.rechecked:
        complete()
        analysis = analyse(capture, budget, noise)
        mixed, result = plan(analysis)
    return Decided(analysis, mixed, result, list(verdicts.values()) + [planner])


def _first_order_sum(result, fmt: Format) -> float | None:
    info = (result.calibration_info.get(fmt.value) or {}) if result is not None else {}
    v = info.get(GAUGE)
    return v if v is not None and math.isfinite(v) else None


def _first_formats(result) -> list[Format]:
    """The low-precision formats of the planner's first choice (each module's fastest allowed format)."""
    if result is None:
        return []
    return sorted({d.first for d in result.decisions.values() if d.first is not None and d.first is not Format.FP32},
                  key=lambda f: f.value)


def planner_recheck(analysis: Analysis, result) -> Recheck:
    """Whether the planner's choices can depend on its inputs at the second order.

    The planner's first choice (each module's fastest allowed format) does not read the impacts' values; only its
    budget repair does, when the plan's calibrated loss change is over the budget. That change, at the two orders'
    upper end, is at most the sum over the formats of the first choice of each format's calibrated total (its
    measured all-format loss change: exact when that format's verdict was re-checked, else at most the loss margin
    times the larger of the audit's own order's figure and the format's first-order sum, the rule of :func:`weigh`),
    or, for a format not calibrated, the margin times its first-choice modules' first-order sum. When that bound is
    within the budget, no order can start a repair, and the choices stand as made."""
    decision = PLANNER
    budget = analysis.budget.max_loss_rel_change
    if result is None:
        return Recheck(decision, {}, False, "no planner: the plan follows the rules, which read no loss impacts")
    bound = _first_choice_bound(analysis, result)
    figures = {"predicted_loss_rel_change_bound": (bound, budget)}
    if result.promotions or bound is None or bound > budget:
        why = ("its budget repair ran" if result.promotions else
               f"its first choice's loss change could reach {bound:.3g} at the second order, over the budget "
               f"{budget:.3g}" if bound is not None else "a format's figures are not finite")
        return Recheck(decision, figures, True, why + ": its impacts were measured at both orders (the reference "
                                                      "pass repeated at the second)")
    return Recheck(decision, figures, False, f"its first choice's loss change is at most {bound:.3g} at either "
                                             f"order, within the budget {budget:.3g}: no repair runs, and the "
                                             "choices do not read the impacts' values")


def _first_choice_bound(analysis: Analysis, result) -> float | None:
    """The bound of :func:`planner_recheck`, relative to the loss (None when a figure is not finite)."""
    noise = analysis.noise
    firsts = {n: d.first for n, d in result.decisions.items() if d.first is not None and d.first is not Format.FP32}
    ref = abs(result.loss_budget / analysis.budget.max_loss_rel_change) if analysis.budget.max_loss_rel_change \
        else abs(analysis.reference_loss)
    ref = ref or 1.0
    total = 0.0
    for f in sorted(set(firsts.values()), key=lambda f: f.value):
        info = result.calibration_info.get(f.value) or {}
        measured = info.get("measured_loss_rel_change")
        both = noise is not None and f in noise.runs and noise.loss_rel_change(f) is not None
        gauge = max(measured or 0.0, info.get(GAUGE) or 0.0)
        cal = None if measured is None else (measured if both else MARGINS[LOSS] * gauge)
        raw = sum(v for n, g in firsts.items() if g is f and (v := (result.raw_impacts.get(n) or {}).get(f))
                  is not None)
        if info.get("note") is None and cal is not None:
            total += cal
        else:  # not calibrated here (factor 1): the raw first-order sum; calibrated at the upper end, at most cal
            total += max(MARGINS[LOSS] * raw / ref, cal or 0.0)
        if not math.isfinite(total):
            return None
    return total


def verification_rechecked(round_: int, loss: float | None, out: float | None, budget: Budget,
                           first_order_sum: float | None = None) -> Recheck:
    """The re-check of one verification pass of the mixed plan (planning/verified.py runs it at the second order
    when :attr:`Recheck.rechecked`); ``first_order_sum``: the plan's (:func:`plan_first_order_sum`), the gauge of
    its loss change."""
    return weigh(f"the mixed plan's verification, pass {round_}",
                 {LOSS: (loss, budget.max_loss_rel_change), "output_rel_error": (out, budget.max_output_rel_error)},
                 gauges={GAUGE: (first_order_sum, budget.max_loss_rel_change)})


def plan_first_order_sum(policy, result, reference_loss: float) -> float:
    """The sum of the planned modules' |first-order loss impacts| in the format ``policy`` runs each in (the
    uncalibrated bound of the plan's loss change, plan.first_order_loss_rel_change), relative to
    ``reference_loss`` (the planner's); inf when a module's impact in its format was not measured."""
    if result is None:
        return math.inf
    total = 0.0
    for name, raw in result.raw_impacts.items():
        f = Format(policy.effective_format(name))
        if f in (Format.FP16, Format.BF16):
            v = raw.get(f)
            if v is None:
                return math.inf
            total += v
    return total / (abs(reference_loss) or 1.0)


PLANNER = "the planner's per-module choices (its budget repair ranks modules by their impacts)"


def plan_with_orders(capture, noise, budget: Budget, plan: Callable[[Analysis], tuple[Any, Any]],
                     recheck: Callable[[tuple[Format, ...]], None], complete: Callable[[], None],
                     choose: Callable[[Decided, list[Recheck]], Any]) -> tuple[Decided, Any]:
    """:func:`decide`, then ``choose(decided, rechecks)`` (planning/verified.py's weighing and verification, each
    verification pass weighed into ``rechecks``). A verification over budget starts repairs, which move the modules
    with the largest impacts first: if the impacts were measured at one order only, they are measured at the second
    (``complete()``), and the plan is made and verified again, as it would have been with them from the start.
    Every decision weighed goes into ``noise.rechecks``."""
    decided = decide(capture, noise, budget, plan, recheck, complete)
    verifications: list[Recheck] = []
    chosen = choose(decided, verifications)
    if _repairs_need_impacts(chosen, noise):
        complete()
        analysis = analyse(capture, budget, noise)
        mixed, result = plan(analysis)
        again = [r for r in decided.rechecks if r.decision != PLANNER] + [Recheck(
            PLANNER, {}, True, "the mixed plan's verification came out over budget, and its repairs move the modules "
                               "with the largest impacts first: impacts measured at both orders, the plan made and "
                               "verified again")]
        decided = Decided(analysis, mixed, result, again)
        verifications = []
        chosen = choose(decided, verifications)
    if noise is not None:
        noise.margins = dict(MARGINS)
        noise.rechecks = [r.to_dict() for r in decided.rechecks + verifications]
    return decided, chosen


def _repairs_need_impacts(chosen, noise) -> bool:
    from ..capture.noise import NOT_NEEDED

    if noise is None or noise.threads is None or noise.impacts is not None or noise.impacts_note != NOT_NEEDED:
        return False
    return any(c.label == "mixed" and c.passes and (c.repairs or c.within_budget is False) for c in chosen.candidates)
