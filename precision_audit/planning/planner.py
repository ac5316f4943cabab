"""The per-module precision planner (docs/plan.md).

Each compute module gets the format that makes the target's estimated step time smallest while the error
budget holds, and never a format whose range its activations or gradients overflow. Sensitivity comes from
measurements the capture already took — each module's first-order loss impact |<dL/dy, y_p - y>| from its
local re-run — so planning costs no extra model passes; the plan is then checked by one verification run and
repaired (audit.py) while the budget is broken.

The additive model: the loss change of a plan is at most the sum of its modules' first-order impacts
(triangle inequality; exact to first order). That bound ignores cancellation between modules and overshoots
the measured change (ResNet-50: 20x), so each format's impacts are first scaled by a calibration factor
(measured whole-format loss change / the sum of the first-order impacts of that format; see rules.py and
docs/plan.md). Modules that share parameters form one group and one format.
Ties break deterministically: the format order below (BF16 first: no loss scaling), then smaller impact, then
the module name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..formats import Format

# When two formats cost the same, prefer the one listed first: BF16 keeps FP32's range (no loss scaling).
FORMAT_PREFERENCE = (Format.BF16, Format.FP16, Format.TF32, Format.FP32)


@dataclass(frozen=True)
class Candidate:
    """A module the planner chooses a format for, with what was measured about it."""

    name: str
    flops: int  # forward GEMM FLOPs of its own
    time_s: dict[Format, float]  # estimated step time of its own ops per format on the target (fp32 included)
    impact: dict[Format, float | None]  # |first-order loss impact| per measured low format; None: not measured
    overflow: dict[Format, str]  # formats it must not run in, with the reason
    group: str | None = None  # modules sharing parameters share a group name
    local_error: dict[Format, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    format: Format
    reason: str
    first: Format | None = None  # the group's first choice, before any promotion for the budget
    promoted: bool = False  # moved off ``first`` to meet the budget
    impact: dict[Format, float] = field(default_factory=dict)  # calibrated |loss impact| per allowed format
    time_s: dict[Format, float] = field(default_factory=dict)  # the group's estimated step time per format
    why_not: tuple[str, ...] = ()  # formats not allowed, with the reason
    predicted_before: float | None = None  # the plan's predicted total when this group was promoted


@dataclass
class PlannerResult:
    decisions: dict[str, Decision]
    loss_budget: float  # absolute loss change allowed
    predicted_loss_change: float  # sum of the chosen formats' impacts
    estimated_time_s: float
    promotions: list[str] = field(default_factory=list)  # human-readable log of the budget repairs
    calibration: dict[Format, float] = field(default_factory=dict)  # factor applied to each format's impacts
    calibration_info: dict = field(default_factory=dict)  # per format: factor, measured, first-order sum, note
    raw_impacts: dict[str, dict[Format, float | None]] = field(default_factory=dict)  # per module, uncalibrated

    def low_precision_flop_share(self, candidates: list[Candidate]) -> float:
        total = sum(c.flops for c in candidates)
        low = sum(c.flops for c in candidates if self.decisions[c.name].format not in (Format.FP32,))
        return low / total if total else 0.0


def _order(fmt: Format) -> int:
    return FORMAT_PREFERENCE.index(fmt) if fmt in FORMAT_PREFERENCE else len(FORMAT_PREFERENCE)


@dataclass
class _Group:
    name: str
    members: list[Candidate]
    scale: dict[Format, float] = field(default_factory=dict)

    def time(self, f: Format) -> float:
        return sum(c.time_s.get(f, c.time_s.get(Format.FP32, 0.0)) for c in self.members)

    def impact(self, f: Format) -> float:
        if f in (Format.FP32,):
            return 0.0
        vals = [c.impact.get(f) for c in self.members]
        if any(v is None for v in vals):
            return math.inf
        return sum(vals) * self.scale.get(f, 1.0)  # type: ignore[arg-type]

    def blocked(self, f: Format) -> str | None:
        for c in self.members:
            if f in c.overflow:
                return f"{c.name}: {c.overflow[f]}"
        return None


def plan_formats(candidates: list[Candidate], formats: tuple[Format, ...], reference_loss: float,
                 max_loss_rel_change: float, calibration: dict[Format, float] | None = None) -> PlannerResult:
    """Choose a format per candidate. ``formats``: the low-precision formats measured and supported;
    ``calibration``: a factor per format applied to every first-order impact of that format (default 1).

    Three steps: each group's fastest allowed format (:func:`_fastest_allowed`); while the predicted loss
    change is over budget, the move with the best saving per unit of time (:func:`_repair`); then each
    module's decision with its reason (:func:`_decisions`).

    Example::

        result = plan_formats(cands, (Format.BF16, Format.FP16), reference_loss=2.3, max_loss_rel_change=1e-2)
        result.decisions["lm_head"].format
    """
    groups: dict[str, _Group] = {}
    for c in sorted(candidates, key=lambda c: c.name):
        key = c.group or c.name
        groups.setdefault(key, _Group(key, [], dict(calibration or {}))).members.append(c)
    budget = max_loss_rel_change * abs(reference_loss) if reference_loss else max_loss_rel_change
    options = tuple(sorted(set(formats), key=_order)) + (Format.FP32,)
    choice, why_not = _fastest_allowed(groups, options)
    promotions, before = _repair(groups, options, choice, budget)
    predicted = sum(groups[n].impact(f) for n, f in choice.items())
    decisions = _decisions(groups, options, choice, why_not, promotions, before, reference_loss,
                           max_loss_rel_change)
    est = sum(groups[n].time(f) for n, f in choice.items())
    return PlannerResult(decisions, budget, predicted, est, promotions, dict(calibration or {}))


def _fastest_allowed(groups: dict[str, _Group], options: tuple[Format, ...]
                     ) -> tuple[dict[str, Format], dict[str, list[str]]]:
    """Each group's fastest format that no overflow refuses and whose impact was measured (FP32 always is);
    and, per group, why each other format was not allowed."""
    choice: dict[str, Format] = {}
    why_not: dict[str, list[str]] = {}
    for g in groups.values():
        allowed = []
        for f in options:
            reason = g.blocked(f) if f is not Format.FP32 else None
            if reason:
                why_not.setdefault(g.name, []).append(f"{f} not allowed ({reason})")
            elif g.impact(f) == math.inf:
                why_not.setdefault(g.name, []).append(f"{f} not measured for it")
            else:
                allowed.append(f)
        choice[g.name] = min(allowed, key=lambda f: (g.time(f), _order(f), g.impact(f)))
    return choice, why_not


def _repair(groups: dict[str, _Group], options: tuple[Format, ...], choice: dict[str, Format], budget: float
            ) -> tuple[list[str], dict[str, float]]:
    """Move groups to more precise formats (``choice`` changed in place) until the predicted loss change fits
    ``budget``: each time the move with the best saving per unit of time; then undo, latest first, the moves the
    budget turned out not to need. Returns the promotions (one sentence each) and each promoted group's
    predicted total before its move."""
    promotions: list[str] = []
    before: dict[str, float] = {}

    def total() -> float:
        return sum(groups[n].impact(f) for n, f in choice.items())

    first = dict(choice)
    # a floor on the time a move costs, so that free moves with negligible gains do not crowd out real fixes
    floor = 0.01 * sum(g.time(Format.FP32) for g in groups.values()) / max(1, len(groups))
    while total() > budget:
        best = None
        for n in sorted(groups):
            g, cur = groups[n], choice[n]
            for f in options:
                if f == cur or (f is not Format.FP32 and (g.blocked(f) or g.impact(f) == math.inf)):
                    continue
                gain = g.impact(cur) - g.impact(f)
                if gain <= 0:
                    continue
                extra = max(g.time(f) - g.time(cur), 0.0)
                score = (gain / (extra + floor + 1e-30), gain, -_order(f))
                if best is None or score > best[0]:
                    best = (score, n, f)
        if best is None:
            break
        _, n, f = best
        before.setdefault(n, total())
        promotions.append(f"{n}: {choice[n]} -> {f} (its first-order loss impact {groups[n].impact(choice[n]):.2e} "
                          f"is the best saving per unit of time; predicted total {total():.2e} > budget {budget:.2e})")
        choice[n] = f
    # undo the moves the budget turned out not to need (latest first)
    for n in reversed([p.split(":", 1)[0] for p in promotions]):
        if choice[n] != first[n]:
            keep = choice[n]
            choice[n] = first[n]
            if total() > budget:
                choice[n] = keep
            else:
                promotions = [p for p in promotions if not p.startswith(n + ":")]
    return promotions, before


def _decisions(groups: dict[str, _Group], options: tuple[Format, ...], choice: dict[str, Format],
               why_not: dict[str, list[str]], promotions: list[str], before: dict[str, float],
               reference_loss: float, max_loss_rel_change: float) -> dict[str, Decision]:
    """One decision per module (every member of a group shares its group's), with the reason people read."""
    decisions: dict[str, Decision] = {}
    for n, f in choice.items():
        g = groups[n]
        promoted = next((p for p in promotions if p.startswith(n + ":")), None)
        if promoted:
            first = _first_choice(g, options)
            rel = g.impact(first) / abs(reference_loss) if reference_loss else g.impact(first)
            reason = (f"{first} alone adds {rel:.2%} to the loss (first-order estimate "
                      f"{g.impact(first):.2e}); the plan's budget is {max_loss_rel_change:.2%}")
        elif f is Format.FP32:
            reason = "; ".join(why_not.get(n, [])) or "no low-precision format is faster"
        else:
            reason = (f"its fastest allowed format (est. {g.time(f) * 1e6:.3g} us/step vs "
                      f"{g.time(Format.FP32) * 1e6:.3g} in fp32); estimated loss impact {g.impact(f):.2e}")
            if why_not.get(n):
                reason += "; " + "; ".join(why_not[n])
        if len(g.members) > 1:
            reason += f" (shares parameters with {', '.join(m.name for m in g.members)}: one format for all)"
        first_f = _first_choice(g, options)
        impacts = {o: g.impact(o) for o in options if o is Format.FP32 or
                   (not g.blocked(o) and g.impact(o) != math.inf)}
        for c in g.members:
            decisions[c.name] = Decision(f, reason, first=first_f, promoted=bool(promoted), impact=impacts,
                                         time_s={o: g.time(o) for o in options}, why_not=tuple(why_not.get(n, [])),
                                         predicted_before=before.get(n))
    return decisions


def _first_choice(g: _Group, options: tuple[Format, ...]) -> Format:
    allowed = [f for f in options if f is Format.FP32 or (not g.blocked(f) and g.impact(f) != math.inf)]
    return min(allowed, key=lambda f: (g.time(f), _order(f), g.impact(f)))
