"""The plan the audit returns: the mixed plan weighed against the uniform formats and verified with the policy
applied, at both reduction orders, repaired while it breaks the budget (the weighing: select.py; docs/plan.md).

The verification runs forward passes of the capture session that measured the formats, so this step needs the
session; everything it decides from is in the analysis, the cost estimates and the planner's result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..analysis.findings import Analysis, Budget
from ..analysis.performance import Performance
from ..formats import Format
from ..policy.schema import Policy
from .planner import PlannerResult
from .rules import Plan, plan_mixed_precision, symmetric_reference_loss
from .second_order import Decided, Recheck, plan_first_order_sum, plan_with_orders, verification_rechecked
from .select import PlanCandidate, choose

#: (loss rel. changes, output rel. errors, error, loss) of one plan, one entry per reduction order measured.
Verification = tuple[list[float], list[float], "str | None", "float | None"]


@dataclass
class ChosenPlan:
    """The plan returned, the candidate it came from, every candidate weighed, and the planner's result."""

    chosen: PlanCandidate
    candidates: list[PlanCandidate]
    planner_result: PlannerResult | None

    @property
    def plan(self) -> Plan:
        return self.chosen.plan


def plan_verifier(session: Any, noise: Any, reference_loss: float, budget: Budget | None = None,
                  rechecks: list[Recheck] | None = None, gauge: Callable[[Policy], float] | None = None
                  ) -> Callable[[Policy, Format], Verification]:
    """``verify(policy, default)``: the policy applied to one forward at this audit's reduction order and, when
    the noise floor was measured, one at the second (capture/noise.py); the upper ends decide. With ``budget``, the
    second order's forward runs only where its figures at the first lie within their margins below the budget, or
    the plan's first-order sum (``gauge(policy)``) says its loss change could reach it (second_order.py), and each
    pass's weighing goes into ``rechecks``."""
    from ..capture.noise import plan_forward

    passes = [0]

    def verify(policy: Policy, default: Format) -> Verification:
        run = session.verify_plan(policy, default)
        ref = reference_loss
        lc = ((abs(run.loss - ref) / abs(ref) if ref else abs(run.loss))
              if run.loss is not None and math.isfinite(run.loss) else math.inf)
        lcs, oes = [lc], [run.output.rel_l2 if run.output else math.inf]
        error = run.error
        if noise is not None:
            passes[0] += 1
            weighed = verification_rechecked(passes[0], lc, oes[0], budget, gauge(policy) if gauge else math.inf) \
                if budget is not None else None
            if weighed is not None and rechecks is not None:
                rechecks.append(weighed)
            if weighed is None or weighed.rechecked:
                alt = plan_forward(session, noise, policy, default)
                a = noise.rel_change(alt.loss)
                lcs.append(a if a is not None else math.inf)
                oes.append(alt.output_rel_error if alt.output_rel_error is not None else math.inf)
                error = error or alt.error
        return lcs, oes, error, run.loss

    return verify


def choose_verified_plan(analysis: Analysis, perf: Performance, formats: tuple[Format, ...], mixed: Plan,
                         planner_result: PlannerResult | None, verify: Callable[[Policy, Format], Verification],
                         make_policy: Callable[[Plan], Policy], say: Callable[[str], None]) -> ChosenPlan:
    """The mixed plan against the uniform formats (select.py), the mixed one verified with ``verify`` and its
    policy from ``make_policy``; repairs move the module with the largest calibrated impact first."""
    def impact_of(name: str, fmt: Format) -> float:
        d = planner_result.decisions.get(name) if planner_result else None
        return (d.impact.get(fmt) or 0.0) if d is not None else 0.0

    chosen, candidates = choose(analysis, perf, formats, mixed, planner_result, verify, make_policy, impact_of, say)
    return ChosenPlan(chosen=chosen, candidates=candidates, planner_result=planner_result)


def plan_and_verify(session: Any, capture: Any, noise: Any, perf: Performance, formats: tuple[Format, ...],
                    target_name: str, budget: Budget, model: Any, say: Callable[[str], None],
                    make_policy: Callable[[Plan, Analysis], Policy]) -> tuple[Analysis, ChosenPlan]:
    """The analysis, the mixed plan and the plan returned (verified), with the second reduction order measured
    only where a decision needs it (second_order.py; docs/plan.md, "Noise floor"). ``noise``: the FP32 noise floor
    of ``session`` (capture/noise.py), None when no format ran."""
    from ..capture.noise import complete, recheck_formats

    def plan(analysis: Analysis) -> tuple[Plan, PlannerResult | None]:
        return plan_mixed_precision(analysis, capture, perf, formats, target_name, model)

    def recheck(todo: tuple[Format, ...]) -> None:
        say(f"second reduction order: the {', '.join(f.value for f in todo)} forward (figures near the budget)")
        recheck_formats(session, noise, todo)

    def complete_orders() -> None:
        say("second reduction order: the reference pass repeated there, for the planner's impacts")
        complete(session, noise, formats)

    def choose(d: Decided, rechecks: list[Recheck]) -> ChosenPlan:
        ref = symmetric_reference_loss(d.analysis)
        verify = plan_verifier(session, noise, d.analysis.reference_loss, d.analysis.budget, rechecks,
                               lambda policy: plan_first_order_sum(policy, d.planner_result, ref))
        return choose_verified_plan(d.analysis, perf, formats, d.mixed, d.planner_result, verify,
                                    lambda p: make_policy(p, d.analysis), say)

    decided, chosen = plan_with_orders(capture, noise, budget, plan, recheck, complete_orders, choose)
    return decided.analysis, chosen
