"""From planner decisions to a Plan for every module, and the plain-rules plan used when the planner cannot run.

:func:`plan_mixed_precision` builds the planner's candidates (modules with a GEMM of their own) from the findings,
runs :func:`~precision_audit.planning.planner.plan_formats`, and gives every other module its format and
reason (tied modules share the planned format). :func:`plan_by_rules` is the fallback when no first-order impact
was measured (no low-precision format, or no module with a GEMM), with these rules:

- The default format is BF16 where the target has BF16 Tensor Cores, else FP16, else FP32.
- A module whose FP32 outputs do not fit the default format (or whose low-precision re-run is not finite)
  is pinned to FP32.
- A module whose local error is far worse than the rest (``LOCAL_ERROR_OUTLIER_RATIO`` times the median
  local error of the modules that compute in that format) is pinned to FP32.

Only the smallest modules responsible are pinned: a parent is not pinned when one of its descendants
already is, and the whole model is never pinned (it would just mean "no mixed precision").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ..analysis.findings import Analysis, LayerFinding
from ..formats import LOW_PRECISION_FORMATS, SPECS, Format
from ..model_names import named_modules

if TYPE_CHECKING:
    from .planner import PlannerResult

LOCAL_ERROR_OUTLIER_RATIO = 10.0


@dataclass(frozen=True)
class LayerPlan:
    format: Format
    reason: str


@dataclass
class Plan:
    default_format: Format
    default_reason: str
    layers: dict[str, LayerPlan] = field(default_factory=dict)  # every module that ran
    overrides: dict[str, LayerPlan] = field(default_factory=dict)  # the ones that differ from the default
    source: str = "rules"
    refusals: dict[Format, list[str]] = field(default_factory=dict)  # format -> modules whose values overflow it
    zero_gradient: dict[str, str] = field(default_factory=dict)  # modules the loss ignores -> why (left at default)


def choose_default(candidates: tuple[Format, ...], target_name: str) -> tuple[Format, str]:
    if Format.BF16 in candidates:
        return Format.BF16, f"{target_name} has BF16 Tensor Cores; BF16 keeps FP32's range, so no loss scaling"
    if Format.FP16 in candidates:
        return Format.FP16, f"{target_name} has no BF16 Tensor Cores; FP16 with loss scaling"
    return Format.FP32, f"no low-precision format was measured for {target_name}"


def _fmt_value(x: float) -> str:
    return f"{x:.3g}"


def plan_by_rules(analysis: Analysis, candidates: tuple[Format, ...], target_name: str) -> Plan:
    """Apply the rules to the findings; every module gets a format and a reason a person can read."""
    default, why = choose_default(candidates, target_name)
    plan = Plan(default_format=default, default_reason=why)
    if default is Format.FP32:
        for L in analysis.layers:
            plan.layers[L.name] = LayerPlan(Format.FP32, why)
        return plan

    flagged: dict[str, str] = {}
    fmax = SPECS[default].max
    median = _median_local(analysis.layers, default)
    for L in analysis.layers:
        if L.name == "" or not L.computes:
            continue
        if L.activation.overflows(default):
            frac = L.activation.fractions[default.value]["overflow"]
            flagged[L.name] = (f"{default} output reaches {_fmt_value(L.activation.amax)} > {_fmt_value(fmax)} "
                               f"({frac:.1%} of its values overflow)")
            continue
        err = L.errors.get(default)
        if err and err.local and err.local.nonfinite:
            flagged[L.name] = f"{default} re-run on exact inputs gives {err.local.nonfinite} non-finite value(s)"
            continue
        if err and err.local and median and median > 0:
            e = err.local.rel_l2
            if e > LOCAL_ERROR_OUTLIER_RATIO * median:
                flagged[L.name] = (f"{default} local error {e:.2e} is {e / median:.0f}x the median {median:.2e} "
                                   f"of the layers that compute in {default}")
    # pin the smallest responsible modules only
    names = set(flagged)
    pinned = {n for n in names if not any(o != n and o.startswith(n + ".") for o in names)}
    for L in analysis.layers:
        if L.name in pinned:
            lp = LayerPlan(Format.FP32, flagged[L.name])
            plan.overrides[L.name] = lp
        elif any(L.name.startswith(p + ".") for p in pinned):
            lp = LayerPlan(Format.FP32, "inside a module pinned to fp32")
        else:
            lp = LayerPlan(default, "default format" if L.computes or L.name == ""
                           else "default format (no computation of its own)")
        plan.layers[L.name] = lp
    return plan


def _median_local(layers: list[LayerFinding], fmt: Format) -> float | None:
    vals = []
    for L in layers:
        e = L.errors.get(fmt)
        if L.name and e and e.local and not e.local.nonfinite and e.local.rel_l2 > 0:
            vals.append(e.local.rel_l2)
    return statistics.median(vals) if vals else None


def zero_gradient(L: LayerFinding, record, module) -> str | None:
    """Why a module's format cannot change the loss, when its output gradient in the FP32 backward is zero."""
    h = record.grad_output
    if h.total and h.zeros == h.total:
        return f"its output gradient dL/dy is zero in all {h.total:,} elements (the loss does not depend on it)"
    if not h.total and module is not None and any(p.requires_grad for p in module.parameters()):
        return "its output gets no gradient in the FP32 backward (the loss does not use it)"
    return None


def refusal(L: LayerFinding, fmt: Format) -> str | None:
    """Why ``fmt`` is refused for this module (overflow of its values in that format), quoting the measured figure.

    Checked for every module that ran — containers and elementwise modules too (docs/plan.md): its FP32
    outputs exceed the format's largest value where the format pass stored them in that format; its re-run alone
    in the format is not finite; or (FP16) its output gradients overflow even at the recommended loss scale.
    """
    if fmt not in LOW_PRECISION_FORMATS:
        return None
    err = L.errors.get(fmt)
    dtype = {Format.FP16: "float16", Format.BF16: "bfloat16"}[fmt]
    stored = err is None or not err.output_dtypes or dtype in err.output_dtypes
    if stored and L.activation.overflows(fmt):
        frac = L.activation.fractions[fmt.value]["overflow"]
        return (f"its output reaches {_fmt_value(L.activation.amax)} in fp32, above {fmt}'s largest value "
                f"{SPECS[fmt].max:g} ({frac:.2%} of its values overflow)")
    if err is not None and err.local is not None and err.local.nonfinite:
        return f"its {fmt} re-run on exact inputs gives {err.local.nonfinite} non-finite value(s)"
    at = L.gradient.output_fp16_at_recommended or {}
    if fmt is Format.FP16 and stored and at.get("overflow", 0) > 0:
        return (f"{at['overflow']:.2%} of its output gradients (largest {_fmt_value(L.gradient.output_amax)}) "
                "overflow fp16 even at the recommended loss scale")
    return None


def both_orders(a: float | None, b: float | None) -> float | None:
    """A module's impact over the two reduction orders: the larger (conservative), or the one that was measured.

    Symmetric, so an audit at 1 thread and one at 2 threads, which measure the same pair of orders in swapped
    roles, give the planner the same number (docs/plan.md, "Noise floor")."""
    if a is None or b is None:
        return b if a is None else a
    return max(a, b)


def symmetric_reference_loss(analysis: Analysis) -> float:
    """The FP32 loss the planner's budget is taken from: the mean over the two reduction orders when there are two
    (a + b == b + a in floating point, so the same at 1 and 2 threads; the FP32 noise floor always measures the
    second on a CPU), else the audit's own."""
    ref = analysis.reference_loss
    noise = analysis.noise
    alt = getattr(noise, "reference_loss", None) if getattr(noise, "threads", None) is not None else None
    if alt is None or not math.isfinite(alt) or not math.isfinite(ref):
        return ref
    return (ref + alt) / 2


def calibrate(analysis: Analysis, cands: list, formats: tuple[Format, ...]) -> tuple[dict[Format, float], dict]:
    """Scale factor per format: the measured whole-format loss change over the sum of the first-order impacts.

    The sum of |<dL/dy, y_p - y>| over modules bounds the loss change from above (triangle inequality) and ignores
    the cancellation between modules, so on deep models it overshoots by 10-20x (docs/plan.md). The
    all-format pass measured the real change; its upper end over the reduction orders is taken. Not calibrated
    (factor 1, and said so) where the pass failed, was not finite, or measured nothing above the FP32 noise floor.
    """
    ref = abs(symmetric_reference_loss(analysis)) or 1.0
    factors: dict[Format, float] = {}
    info: dict[str, dict] = {}
    floor = analysis.noise.loss_rel if analysis.noise is not None and math.isfinite(analysis.noise.loss_rel) else 0.0
    alt = getattr(analysis.noise, "reference_loss", None)
    if alt is not None and math.isfinite(alt) and math.isfinite(analysis.reference_loss):
        floor = abs(alt - analysis.reference_loss) / ref  # the same figure whichever order is the audit's own
    for f in formats:
        total = sum(c.impact[f] for c in cands if c.impact.get(f) is not None)
        s = analysis.summaries.get(f)
        measured = None
        if s is not None and s.loss_rel_change is not None and math.isfinite(s.loss_rel_change):
            measured = (s.loss_rel_change_range[1] if s.loss_rel_change_range else s.loss_rel_change)
        note = None
        if measured is None:
            note = f"not calibrated: the all-{f} pass has no finite loss"
        elif total <= 0:
            note = f"not calibrated: no first-order impact was measured in {f}"
        elif measured <= floor:
            note = (f"not calibrated: the all-{f} loss change {measured:.2e} is within the FP32 noise floor "
                    f"{floor:.2e}")
        factor = measured * ref / total if note is None and measured is not None else 1.0
        factors[f] = factor
        info[f.value] = {"factor": factor, "measured_loss_rel_change": measured,
                         "first_order_sum_rel": total / ref, "note": note}
    return factors, info


def plan_mixed_precision(analysis: Analysis, capture, perf, candidates_formats: tuple[Format, ...], target_name: str,
                         model) -> tuple[Plan, PlannerResult | None]:
    """The cost-aware mixed plan (planner.py) when first-order impacts were measured, else :func:`plan_by_rules`.

    The planner decides the modules with a GEMM of their own (:func:`_planner_candidates`); every other module
    gets its format and reason here (:func:`_layer_plans`): overflow refusals, containers, tied parameters.
    This is one candidate; planning/select.py weighs it against the uniform formats.

    Its per-module candidates are the 16-bit formats. TF32 is not one: it is a pair of global switches (cuBLAS,
    cuDNN) rather than a per-module autocast dtype, so a measured TF32 pass enters the plan as the "uniform tf32"
    candidate of select.py and as the policy's TF32 switches (planning/build_policy.py; docs/plan.md, "TF32").
    """
    from .planner import FORMAT_PREFERENCE, plan_formats

    candidates_formats = tuple(f for f in candidates_formats if f in LOW_PRECISION_FORMATS)
    default, why = choose_default(candidates_formats, target_name)
    if default is Format.FP32:
        return plan_by_rules(analysis, candidates_formats, target_name), None
    modules = dict(named_modules(model))
    groups = _tied_groups(model)
    cands, zero = _planner_candidates(analysis, capture, perf, candidates_formats, modules, groups)
    if not cands:
        return plan_by_rules(analysis, candidates_formats, target_name), None
    factors, cal_info = calibrate(analysis, cands, candidates_formats)
    result = plan_formats(cands, candidates_formats, symmetric_reference_loss(analysis),
                          analysis.budget.max_loss_rel_change, calibration=factors)
    result.calibration_info = cal_info
    result.raw_impacts = {c.name: dict(c.impact) for c in cands}
    # the default is the format that covers most GEMM FLOPs (ties: the preferred one)
    flops: dict[Format, int] = {}
    for c in cands:
        f = result.decisions[c.name].format
        flops[f] = flops.get(f, 0) + max(c.flops, 1)
    low = {f: n for f, n in flops.items() if f is not Format.FP32} or flops
    default = max(low, key=lambda f: (low[f], -FORMAT_PREFERENCE.index(f)))
    plan = Plan(default_format=default,
                default_reason=why if default is choose_default(candidates_formats, target_name)[0]
                else f"{default} covers most of the GEMM FLOPs in the plan", source="planner")
    refused = _settle_unseen_and_refused(analysis, result, zero, groups, default)
    _layer_plans(analysis, capture, plan, result, refused)
    _share_tied_formats(plan, result, groups, _baseline(analysis, capture, result, refused, default))
    by_name = {L.name: L for L in analysis.layers}
    for r in capture.layers:  # modules without a GEMM are labelled too (their format is the op policy's)
        if r.name and r.name not in zero and r.computes and \
                (z := zero_gradient(by_name[r.name], r, modules.get(r.name))):
            zero[r.name] = z
            if r.name not in plan.overrides and r.name not in result.decisions:
                plan.layers[r.name] = LayerPlan(plan.layers[r.name].format, f"{z}: its format cannot change the "
                                                                            "loss; default format")
    plan.zero_gradient = dict(zero)
    plan.refusals = {f: [n for n in (L.name for L in analysis.layers) if refusal(by_name[n], f)]
                     for f in candidates_formats}
    return plan, result


def _planner_candidates(analysis: Analysis, capture, perf, formats: tuple[Format, ...], modules: dict,
                        groups: dict[str, str]) -> tuple[list, dict[str, str]]:
    """The planner's candidates: every module with a GEMM of its own and an estimated FP32 time, with its
    measured first-order impact per format (the larger of the two reduction orders) and the formats its values
    overflow; and the modules whose output gradient is zero (their impact is 0 whatever the format)."""
    from .planner import Candidate

    by_name = {L.name: L for L in analysis.layers}
    second = getattr(analysis.noise, "impacts", None)  # the impacts at the second reduction order (noise.py)
    cands = []
    zero: dict[str, str] = {}
    for r in capture.layers:
        if not r.name or not r.ops.gemms:
            continue  # without a GEMM of its own, autocast's op policy decides its precision, not the plan
        lp = perf.layers.get(r.name)
        times = {Format(k): v for k, v in lp.cost.estimated_step_time_s.items()} if lp and lp.cost else {}
        if Format.FP32 not in times:
            continue
        L = by_name[r.name]
        z = zero_gradient(L, r, modules.get(r.name))
        if z:
            zero[r.name] = z
        impact: dict[Format, float | None] = {}
        overflow: dict[Format, str] = {}
        for f in formats:
            fs = r.formats.get(f)
            err = L.errors.get(f)
            if fs is None or err is None:
                impact[f] = None
                continue
            if z:
                impact[f] = 0.0
            elif fs.impact_measured:
                impact[f] = fs.loss_impact_abs
            elif err.local is not None and err.local.rel_l2 == 0:
                impact[f] = 0.0
            else:
                impact[f] = None
            if not z and second is not None:
                impact[f] = both_orders(impact[f], (second.get(r.name) or {}).get(f))
            why_refused = refusal(L, f)
            if why_refused:
                overflow[f] = why_refused
        cands.append(Candidate(name=r.name, flops=r.ops.gemm_flops, time_s=times, impact=impact,
                               overflow=overflow, group=groups.get(r.name),
                               local_error={f: (e.local.rel_l2 if (e := L.errors.get(f)) and e.local else None)
                                            for f in formats}))
    return cands, zero


def _settle_unseen_and_refused(analysis: Analysis, result, zero: dict[str, str], groups: dict[str, str],
                               default: Format) -> dict[str, str]:
    """Modules the loss cannot see go to the default; returns the modules without a planner decision that
    the default's overflow refuses (the smallest responsible ones), and moves the children of a refused
    container to FP32 with it (``result.decisions`` changed in place)."""
    by_name = {L.name: L for L in analysis.layers}
    # Modules whose output gradient is zero: the loss cannot see their format; they stay at the default.
    for n, z in zero.items():
        if not refusal(by_name[n], default) and n not in groups:  # tied modules keep their group's one format
            result.decisions[n] = replace(result.decisions[n], format=default, promoted=False,
                                          reason=f"{z}: its format cannot change the loss, so it stays at the "
                                                 f"default {default}")
    # Overflow refuses a format for any module, containers and elementwise modules included: those without a GEMM
    # of their own run in fp32 (inputs cast up), the smallest responsible modules only.
    refusing = {L.name: r for L in analysis.layers if L.name and (r := refusal(L, default))}
    refused: dict[str, str] = {}
    for n, r in refusing.items():
        if n in result.decisions or (by_name[n].is_leaf and not by_name[n].computes):
            continue  # the planner decided it; or it passes its input on unchanged (the overflow is upstream)
        if any(o.startswith(n + ".") and by_name[o].activation.amax >= by_name[n].activation.amax for o in refusing):
            continue  # its output is a descendant's, refused there
        refused[n] = r
    # A container refused for its own op (a residual add of two children) runs in fp32 as a whole: its children's
    # low-precision outputs would otherwise meet in the same overflowing op.
    for n, why_r in refused.items():
        if by_name[n].is_leaf:
            continue
        for m, d in list(result.decisions.items()):
            if m.startswith(n + ".") and d.format is not Format.FP32:
                result.decisions[m] = replace(d, format=Format.FP32, promoted=False,
                                              reason=f"inside {n}, which runs in fp32: {default} refused there, "
                                                     f"{why_r}")
    return refused


def _baseline(analysis: Analysis, capture, result, refused: dict[str, str], default: Format):
    """``baseline(name)``: the format a module runs in unless overridden: its nearest pinned container's, else
    the default."""
    by_name = {L.name: L for L in analysis.layers}
    records = {r.name: r for r in capture.layers}
    pinned_parents = {n: d.format for n, d in result.decisions.items()
                      if d.format is not default and not records[n].is_leaf}
    pinned_parents.update({n: Format.FP32 for n in refused if not by_name[n].is_leaf})

    def baseline(name: str) -> Format:
        inherited = [(p, f) for p, f in pinned_parents.items() if name.startswith(p + ".")]
        return max(inherited, key=lambda pf: len(pf[0]))[1] if inherited else default

    return baseline


def _layer_plans(analysis: Analysis, capture, plan: Plan, result, refused: dict[str, str]) -> None:
    """Every module's format and reason into ``plan.layers`` (and ``plan.overrides`` where it differs from the
    format it would otherwise run in)."""
    default = plan.default_format
    baseline = _baseline(analysis, capture, result, refused, default)
    by_name = {L.name: L for L in analysis.layers}
    ref = abs(symmetric_reference_loss(analysis)) or 1.0
    budget_rel = analysis.budget.max_loss_rel_change
    for L in analysis.layers:
        d = result.decisions.get(L.name)
        base = baseline(L.name)
        if d is not None:
            reason = _override_reason(d, base, by_name[L.name], ref, budget_rel) if d.format is not base \
                else (d.reason if d.reason.startswith("inside ") else _kept_reason(d, base, ref, budget_rel))
            lp = LayerPlan(d.format, reason)
            if d.format is not base:
                plan.overrides[L.name] = lp
        elif L.name in refused:
            lp = LayerPlan(Format.FP32, f"fp32 instead of {base}: {base} refused, {refused[L.name]}")
            plan.overrides[L.name] = lp
        else:
            inherited = base is not default
            lp = LayerPlan(base, "inside a module planned as " + str(base) if inherited else
                           "default format" + ("" if L.name == "" else
                                               " (no GEMM of its own: autocast's op policy decides its precision)"
                                               if L.computes else " (no computation of its own)"))
        plan.layers[L.name] = lp


def _share_tied_formats(plan: Plan, result, groups: dict[str, str], baseline) -> None:
    """Modules tied to a planned module share its format, GEMM or not (an Embedding tied to an LM head)."""
    members: dict[str, list[str]] = {}
    for n, g in groups.items():
        members.setdefault(g, []).append(n)
    for names in members.values():
        planned = [result.decisions[n] for n in names if n in result.decisions]
        if not planned:
            continue
        fmt = planned[0].format
        for n in names:
            if n in result.decisions or n not in plan.layers:
                continue
            lp = LayerPlan(fmt, f"shares parameters with {', '.join(m for m in names if m in result.decisions)}: "
                                "one format for all")
            plan.layers[n] = lp
            if fmt is not baseline(n):
                plan.overrides[n] = lp
            else:
                plan.overrides.pop(n, None)


def _us(t: float | None) -> str:
    return "not estimated" if t is None else f"{t * 1e6:.3g} us"


def _override_reason(d, base: Format, L: LayerFinding, ref: float, budget_rel: float) -> str:
    """Why this module runs in ``d.format`` rather than ``base`` (the format it would otherwise run in)."""
    chosen = d.format
    head = f"{chosen} instead of {base}"
    tied = (" (shares parameters" + d.reason.split(" (shares parameters", 1)[1]) if " (shares parameters" in d.reason \
        else ""
    why_base = refusal(L, base) if base in LOW_PRECISION_FORMATS else None
    if why_base is None:
        why_base = next((w.split(" not allowed (", 1)[1][:-1] for w in d.why_not
                         if w.startswith(f"{base} not allowed")), None)
    if why_base:
        return f"{head}: {base} refused, {why_base}" + tied
    if base is not Format.FP32 and base not in d.impact:
        note = (L.errors[base].local_note if L.errors.get(base) else None) or "no local re-run in it"
        return f"{head}: {base}'s effect on the loss was not measured for it ({note})" + tied
    ib, ic = d.impact.get(base), d.impact.get(chosen, 0.0)
    tb, tc = d.time_s.get(base), d.time_s.get(chosen)
    if ib is not None and ic is not None and ic < ib and (d.promoted or (tb is not None and tc is not None
                                                                          and tc >= tb)):
        before = f"; the plan's estimated loss change was {d.predicted_before / ref:.2e}" \
            if d.predicted_before is not None else ""
        return (f"{head}: {base} here adds an estimated {ib / ref:.2e} relative loss change "
                f"({chosen}: {ic / ref:.2e}){before}, over the budget {budget_rel:.2e}; this move saved the most "
                f"loss per unit of step time" + tied)
    if tb is not None and tc is not None and tc < tb:
        return (f"{head}: estimated {_us(tc)} per step vs {_us(tb)} in {base}; its estimated loss change "
                f"{(ic or 0.0) / ref:.2e} (budget {budget_rel:.2e})" + tied)
    return (f"{head}: same estimated time ({_us(tc)} per step); at equal time {chosen} comes first in the "
            f"preference order (bf16, fp16, tf32, fp32: bf16 needs no loss scaling)" + tied)


def _kept_reason(d, base: Format, ref: float, budget_rel: float) -> str:
    if "cannot change the loss" in d.reason:
        return d.reason
    i = d.impact.get(base)
    fig = f"estimated loss change {i / ref:.2e}" if i is not None else "loss effect not measured"
    return f"{'default format' if base is d.format else base}: {fig} (budget {budget_rel:.2e} for the whole plan)"


def _tied_groups(model) -> dict[str, str]:
    """Modules sharing a parameter object get one group name (weight tying: one format for all)."""
    owners: dict[int, list[str]] = {}
    for name, m in named_modules(model):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    groups: dict[str, str] = {}
    for names in owners.values():
        if len(names) > 1:
            g = "+".join(sorted(names))
            for n in names:
                groups[n] = g
    return groups
