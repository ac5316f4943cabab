"""A first precision plan from plain rules (the cost-aware planner replaces it later).

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
