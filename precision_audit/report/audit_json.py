"""audit.json (schema ``precision-audit/audit``): every measurement, for machines.

Floats that are not finite (an overflowed error metric, say) are written as ``null``; the neighbouring
``nonfinite`` counts say why. The JSON Schema is ``precision_audit/schemas/audit.schema.json``.
"""

from __future__ import annotations

import math
from typing import Any

from ..analysis.findings import Analysis, FormatError, LayerFinding, RangeFinding
from ..capture.stats import ErrorStats
from ..planning.rules import Plan

if False:  # typing only
    from ..analysis.performance import LayerPerformance

AUDIT_SCHEMA_ID = "precision-audit/audit"
AUDIT_VERSION = 1


def clean(x: Any) -> Any:
    """Make a value JSON-safe: non-finite floats -> None, tuples -> lists, int keys -> str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean(v) for v in x]
    return x


def error_dict(e: ErrorStats | None) -> dict[str, Any] | None:
    if e is None:
        return None
    # sqnr_db is null both for an exact match (infinite SQNR: "exact" is true) and for a non-finite result
    # ("nonfinite" > 0); JSON has no infinity.
    return {"rel_l2": e.rel_l2, "sqnr_db": e.sqnr_db, "max_abs": e.max_abs if not e.nonfinite else math.inf,
            "cosine": e.cosine, "nonfinite": e.nonfinite, "elements": e.n,
            "exact": e.nonfinite == 0 and e.sum_diff2 == 0, "fp32_nonfinite": e.ref_nonfinite}


def _range_dict(r: RangeFinding) -> dict[str, Any]:
    return {
        "amax": r.amax,
        "elements": r.elements,
        "zeros": r.zeros,
        "nonfinite": r.nonfinite,
        "headroom_bits": r.headroom_bits,
        "fractions": r.fractions,
        "exponent_histogram": {str(k): v for k, v in sorted(r.exponent_histogram.items())},
    }


def _format_error(e: FormatError) -> dict[str, Any]:
    return {"local": error_dict(e.local), "local_note": e.local_note, "accumulated": error_dict(e.accumulated)}


def layer_dict(L: LayerFinding, plan: Plan, perf: "LayerPerformance | None", time_label: str) -> dict[str, Any]:
    g = L.gradient
    lp = plan.layers[L.name]
    return {
        "name": L.name,
        "type": L.type,
        "depth": L.depth,
        "is_leaf": L.is_leaf,
        "computes": L.computes,
        "calls": L.calls,
        "own_parameters": L.param_count,
        "parameters": L.total_param_count,
        "output_shapes": L.output_shapes,
        "error": {f.value: _format_error(e) for f, e in L.errors.items()},
        "activation": {
            **_range_dict(L.activation),
            "by_format": {f.value: {"amax": e.activation_amax, "nonfinite": e.activation_nonfinite,
                                    "dtypes": e.output_dtypes} for f, e in L.errors.items()},
        },
        "gradient": {
            "output": {"amax": g.output_amax, "fp16": {"unscaled": g.output_fp16_unscaled,
                                                       "at_recommended": g.output_fp16_at_recommended},
                       "exponent_histogram": {str(k): v for k, v in sorted(g.output_exponent_histogram.items())}},
            "parameters": None if g.param_amax is None else {
                "amax": g.param_amax, "fp16": {"unscaled": g.param_fp16_unscaled,
                                               "at_recommended": g.param_fp16_at_recommended}},
            "nonfinite": g.nonfinite,
            "fp32_nonfinite": {"output": g.fp32_output_nonfinite, "parameters": g.fp32_param_nonfinite},
        },
        "alignment": perf.alignment if perf else None,
        "alignment_note": (None if perf and perf.alignment else
                           "no GEMM, convolution or attention of its own" if perf else "not measured"),
        "cost": None if not perf or perf.cost is None else {
            **perf.cost,
            "estimated_note": "estimate for the target GPU (roofline; see estimates.assumptions)",
            "measured_forward_time_s": perf.measured_time_s or None,
            "measured_on": time_label if perf.measured_time_s else None,
            "saved_activation_bytes": perf.saved_bytes or None,
        },
        "cost_note": None if perf and perf.cost else "no computation of its own",
        "plan": {"format": lp.format.value, "reason": lp.reason},
        "notes": L.notes,
    }


def summary_dict(analysis: Analysis, step_times: dict[str, list[float]], time_label: str,
                 estimates: dict[str, float], target_name: str) -> dict[str, Any]:
    def times(key: str) -> dict[str, Any]:
        t = step_times.get(key)
        est = estimates.get(key)
        return {
            "measured_s": min(t) if t else None,
            "measured_on": time_label if t else None,
            "measured_note": None if t else "not measured: the pass failed or --steps 0",
            "estimated_s": est,
            "estimated_note": (f"estimate for {target_name}: roofline over the shapes seen (see estimates)"
                               if est is not None else f"not estimated: {target_name} has no peak for this format"),
        }

    bad = analysis.fp32_nonfinite
    out: dict[str, Any] = {"fp32": {
        "loss": analysis.reference_loss, "step_time": times("fp32"),
        # FP32's own non-finite values (its loss and output are finite, or the audit stops): the model's problem,
        # not counted against any format (README.md, audit.json)
        "nonfinite": {"outputs": bad.outputs, "output_grads": bad.output_grads, "param_grads": bad.param_grads,
                      "modules": bad.modules, "note": bad.describe() if bad.any else None},
    }}
    for f, s in analysis.summaries.items():
        out[f.value] = {
            "loss": s.loss,
            "loss_rel_change": s.loss_rel_change,
            "output": error_dict(s.output),
            "nonfinite": {"outputs": s.output_nonfinite, "param_grads": s.param_grads_nonfinite,
                          "param_grads_also_in_fp32": s.param_grads_nonfinite_shared},
            "loss_scale": s.loss_scale,
            "pass_error": s.error,
            "safe": s.safe,
            "verdict": s.verdict,
            "step_time": times(f.value),
        }
    return out
