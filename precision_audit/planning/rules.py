"""From planner decisions to a Plan for every module, and the plain-rules plan used when the planner cannot run.

:func:`make_planned` builds the planner's candidates (modules with a GEMM of their own) from the findings,
runs :func:`~precision_audit.planning.planner.plan_formats`, and gives every other module its format and
reason (tied modules share the planned format). :func:`make_plan` is the fallback when no first-order impact
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

import statistics
from dataclasses import dataclass, field

from ..analysis.findings import Analysis, LayerFinding
from ..formats import SPECS, Format

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


def choose_default(candidates: tuple[Format, ...], target_name: str) -> tuple[Format, str]:
    if Format.BF16 in candidates:
        return Format.BF16, f"{target_name} has BF16 Tensor Cores; BF16 keeps FP32's range, so no loss scaling"
    if Format.FP16 in candidates:
        return Format.FP16, f"{target_name} has no BF16 Tensor Cores; FP16 with loss scaling"
    return Format.FP32, f"no low-precision format was measured for {target_name}"


def _fmt_value(x: float) -> str:
    return f"{x:.3g}"


def make_plan(analysis: Analysis, candidates: tuple[Format, ...], target_name: str) -> Plan:
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
            lp = LayerPlan(default, "default format" if L.computes or L.name == "" else "default format (no computation of its own)")
        plan.layers[L.name] = lp
    return plan


def _median_local(layers: list[LayerFinding], fmt: Format) -> float | None:
    vals = []
    for L in layers:
        e = L.errors.get(fmt)
        if L.name and e and e.local and not e.local.nonfinite and e.local.rel_l2 > 0:
            vals.append(e.local.rel_l2)
    return statistics.median(vals) if vals else None


def make_planned(analysis: Analysis, capture, perf, candidates_formats: tuple[Format, ...], target_name: str,
                 model) -> tuple[Plan, "PlannerResult | None"]:
    """The cost-aware plan (planner.py) when first-order impacts were measured, else the plain rules."""
    from .planner import Candidate, plan_formats

    default, why = choose_default(candidates_formats, target_name)
    if default is Format.FP32:
        return make_plan(analysis, candidates_formats, target_name), None
    by_name = {L.name: L for L in analysis.layers}
    records = {r.name: r for r in capture.layers}
    groups = _tied_groups(model)
    cands = []
    for r in capture.layers:
        if not r.name or not r.ops.gemms:
            continue  # without a GEMM of its own, autocast's op policy decides its precision, not the plan
        cost = (perf.layers.get(r.name).cost or {}) if perf.layers.get(r.name) else {}
        times = {Format(k): v for k, v in (cost.get("estimated_step_time_s") or {}).items()}
        if Format.FP32 not in times:
            continue
        L = by_name[r.name]
        impact: dict[Format, float | None] = {}
        overflow: dict[Format, str] = {}
        for f in candidates_formats:
            fs = r.formats.get(f)
            err = L.errors.get(f)
            if fs is None or err is None:
                impact[f] = None
                continue
            if fs.impact_measured:
                impact[f] = fs.loss_impact_abs
            elif err.local is not None and err.local.rel_l2 == 0:
                impact[f] = 0.0
            else:
                impact[f] = None
            if L.activation.overflows(f):
                frac = L.activation.fractions[f.value]["overflow"]
                overflow[f] = (f"{f} output reaches {L.activation.amax:.3g} > {_fmt_value(SPECS[f].max)} "
                               f"({frac:.1%} of its values overflow)")
            elif err.local is not None and err.local.nonfinite:
                overflow[f] = f"{f} re-run on exact inputs gives {err.local.nonfinite} non-finite value(s)"
            elif f is Format.FP16 and (L.gradient.output_fp16_at_recommended or {}).get("overflow", 0) > 0:
                overflow[f] = "its gradients overflow fp16 even at the recommended loss scale"
        cands.append(Candidate(name=r.name, flops=r.ops.gemm_flops, time_s=times, impact=impact,
                               overflow=overflow, group=groups.get(r.name),
                               local_error={f: (L.errors[f].local.rel_l2 if L.errors.get(f) and L.errors[f].local
                                                else None) for f in candidates_formats}))
    if not cands:
        return make_plan(analysis, candidates_formats, target_name), None
    result = plan_formats(cands, candidates_formats, analysis.reference_loss, analysis.budget.max_loss_rel_change)
    # the default is the format that covers most GEMM FLOPs (ties: the preferred one)
    flops: dict[Format, int] = {}
    for c in cands:
        f = result.decisions[c.name].format
        flops[f] = flops.get(f, 0) + max(c.flops, 1)
    low = {f: n for f, n in flops.items() if f is not Format.FP32} or flops
    from .planner import FORMAT_PREFERENCE

    default = max(low, key=lambda f: (low[f], -FORMAT_PREFERENCE.index(f)))
    plan = Plan(default_format=default, default_reason=why if default is choose_default(candidates_formats, target_name)[0]
                else f"{default} covers most of the GEMM FLOPs in the plan", source="planner")
    pinned_parents = {n: d.format for n, d in result.decisions.items()
                      if d.format is not default and not records[n].is_leaf}
    for L in analysis.layers:
        d = result.decisions.get(L.name)
        inherited = next((f for p, f in pinned_parents.items() if L.name.startswith(p + ".")), None)
        if d is not None:
            lp = LayerPlan(d.format, d.reason)
            if d.format is not (inherited or default):
                plan.overrides[L.name] = lp
        else:
            fmt = inherited or default
            lp = LayerPlan(fmt, "inside a module planned as " + str(fmt) if inherited else
                           "default format" + ("" if L.name == "" else
                                               " (no GEMM of its own: autocast's op policy decides its precision)"
                                               if L.computes else " (no computation of its own)"))
        plan.layers[L.name] = lp
    # modules tied to a planned module share its format, GEMM or not (an Embedding tied to an LM head)
    members: dict[str, list[str]] = {}
    for n, g in groups.items():
        members.setdefault(g, []).append(n)
    for g, names in members.items():
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
            if fmt is not default:
                plan.overrides[n] = lp
            else:
                plan.overrides.pop(n, None)
    return plan, result


def _tied_groups(model) -> dict[str, str]:
    """Modules sharing a parameter object get one group name (weight tying: one format for all)."""
    owners: dict[int, list[str]] = {}
    for name, m in model.named_modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    groups: dict[str, str] = {}
    for names in owners.values():
        if len(names) > 1:
            g = "+".join(sorted(names))
            for n in names:
                groups[n] = g
    return groups
