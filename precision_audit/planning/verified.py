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

from ..analysis.findings import Analysis
from ..analysis.performance import Performance
from ..formats import Format
from ..policy.schema import Policy
from .planner import PlannerResult
from .rules import Plan
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


def plan_verifier(session: Any, noise: Any, reference_loss: float) -> Callable[[Policy, Format], Verification]:
    """``verify(policy, default)``: the policy applied to one forward at this audit's reduction order and, when
    the noise floor was measured, one at the second (capture/noise.py); the upper ends decide."""
    from ..capture.noise import plan_forward

    def verify(policy: Policy, default: Format) -> Verification:
        run = session.verify_plan(policy, default)
        ref = reference_loss
        lc = ((abs(run.loss - ref) / abs(ref) if ref else abs(run.loss))
              if run.loss is not None and math.isfinite(run.loss) else math.inf)
        lcs, oes = [lc], [run.output.rel_l2 if run.output else math.inf]
        error = run.error
        if noise is not None:
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
