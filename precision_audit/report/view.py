"""The report's view model: what report.html shows that is more than one field, read from the audit's typed
record (precision_audit/record/__init__.py), picked, labelled and charted (docs/report.md).

The view computes nothing new: every figure is a field of the record. Fields audit.json marks optional (per
layer ``alignment`` and ``cost``; ``summary.<format>.step_time.estimated_s``; top-level ``estimates``,
``memory``, ``traces`` and ``verify``; the planner's fields in ``plan``) are None in the record when absent,
and the view then carries the matching note ("not measured: <why>"): the record's ``*_note`` field, or a
top-level ``<section>_note`` that a file may hold (kept in ``AuditRecord.extra``). What is a map by nature
(the alignment findings, a format's memory columns) stays one (docs/record.md).

Example::

    view = build_view(from_json(json.load(open("audit/audit.json"))), policy=None)
    view["headline"]["sentence"], view["speedup"]["bf16"]
"""

from __future__ import annotations

import json
import math
import urllib.parse
from collections.abc import Mapping
from typing import Any

from markupsafe import Markup

from .. import record as R
from ..formats import RANGE_FORMATS, SPECS, Format
from ..record.codec import read, to_json
from . import charts
from .grouped import columns, gemm_modules, layer_rows, layer_tags, plan_summary
from .groups import GROUPED_VIEW_MIN_LAYERS, grouping
from .headline import headline, warnings
from .numbers import fmt_num, fmt_value
from .picks import (
    CURVE_KEYS,
    cost_times,
    given,
    is_gap,
    is_number,
    loss_curve_series,
    misaligned_rows,
    note_of,
    output_gradient,
    relative_to_fp32,
    speedup,
    step_time,
    summary_of,
)

# The section ids every report has, in page order (tests check them; the table of contents links them).
SECTIONS: tuple[tuple[str, str], ...] = (
    ("verdict", "Verdict"),
    ("facts", "Run facts"),
    ("warnings", "Warnings"),
    ("formats", "Formats"),
    ("charts", "Charts"),
    ("loss-scale", "FP16 loss scaling"),
    ("layers", "Layers"),
    ("alignment", "Alignment"),
    ("memory", "Memory"),
    ("verify", "Verification"),
    ("plan", "Plan"),
    ("policy", "Policy"),
    ("emulation", "Emulation"),
)

# Formats whose ranges the range chart draws as bands (limits from precision_audit.formats.SPECS).
BAND_FORMATS: tuple[Format, ...] = RANGE_FORMATS

# --- the view model ---------------------------------------------------------------------------------------


def build_view(audit: R.AuditRecord, policy: Mapping[str, Any] | None) -> dict[str, Any]:
    """Everything the template shows that is more than one field: picked, labelled, and charted."""
    formats: list[str] = list(audit.formats or [])
    layers = audit.layers or []
    est = audit.estimates if isinstance(audit.estimates, R.Estimates) else None
    names = [L.name or "" for L in layers]
    all_formats = ["fp32", *formats]

    view: dict[str, Any] = {"sections": SECTIONS, "formats": formats}
    # The template's per-format and per-layer records: a format without a summary entry, or a layer without an
    # output gradient, reads as an empty record (every field None: "not measured").
    view["summaries"] = {f: summary_of(audit, f) or read(R.FormatSummary, {}) for f in all_formats}
    view["step_times"] = {f: step_time(audit, f) or read(R.StepTime, {}) for f in all_formats}
    view["output_gradients"] = [output_gradient(L) or read(R.OutputGradient, {}) for L in layers]
    view["options"] = list(to_json(audit.options).items())  # every option, those a later version adds included
    g = grouping(layers)
    view["grouping"] = g
    # A model with many modules gets its per-module tables collapsed behind the grouped views (docs/report.md,
    # "Models with hundreds of layers"); every module stays one search or one click away.
    view["collapse"] = len(layers) > GROUPED_VIEW_MIN_LAYERS
    view["group_cols"] = columns(formats)
    view["group_rows"] = layer_rows(audit, g, formats) if view["collapse"] and g.grouped else []
    view["layer_tags"] = layer_tags(g, len(layers))
    view["plan_summary"] = plan_summary(audit, g)
    view["headline"] = headline(audit, formats, g)
    view["predicted_rel"] = relative_to_fp32(audit.plan.predicted_loss_change, audit)
    view["warnings"] = warnings(audit, formats)

    # Per-format step times: estimated on the target (the headline) and measured where the audit ran.
    view["speedup"] = {f: speedup(audit, f) for f in all_formats}
    # a column of "not measured" in every emulated report says nothing: the note under the table says why
    view["has_measured"] = any((st := step_time(audit, f)) is not None and st.measured_s is not None
                               for f in all_formats)
    view["has_estimates"] = any((st := step_time(audit, f)) is not None and st.estimated_s is not None
                                for f in all_formats)
    skipped = {x.format for x in audit.formats_skipped or []}
    est_steps = (est.step_time_s if est is not None and isinstance(est.step_time_s, Mapping) else {})
    view["estimate_only"] = [(f, t, speedup(audit, f)) for f, t in est_steps.items()
                             if f not in all_formats and f not in skipped]
    view["estimate_assumptions"] = list((est.assumptions if est is not None else None) or [])

    _layer_views(view, audit, layers, names, formats, all_formats)

    verify = audit.verify if given(audit.verify) else None
    curves = loss_curve_series(verify)
    view["chart_verify"] = charts.loss_curves(curves) if curves else None
    view["verify_rest"] = ({k: v for k, v in to_json(verify).items() if k not in CURVE_KEYS}
                           if isinstance(audit.verify, R.VerifyResult) else None)
    view["verify_note"] = note_of(audit, "verify", "not measured: this audit.json has no A/B training run "
                                                 "(precision-audit verify trains one)")

    view["memory"] = _memory_view(audit.memory) if isinstance(audit.memory, R.Memory) and given(audit.memory) else None
    view["memory_note"] = note_of(audit, "memory", "not measured: this audit.json has no memory figures")
    from ..fp8.report import fp8_view  # the FP8 section (issue 16, docs/fp8.md)

    view["fp8"] = fp8_view(audit.fp8)

    from .terminal import PROFILER_TAB, TRACES_WHEN

    view["traces_when"], view["profiler_tab"] = TRACES_WHEN, PROFILER_TAB
    view.update(_policy_view(policy))
    return view


def _layer_views(view: dict[str, Any], audit: R.AuditRecord, layers: list[R.LayerReport], names: list[str],
                 formats: list[str], all_formats: list[str]) -> None:
    """The layers' costs, alignment and charts."""
    view["layer_times"] = [cost_times(L.cost, all_formats) for L in layers]
    view["has_cost"] = any(given(L.cost) for L in layers)
    view["cost_gaps"] = sorted({L.cost_note for L in layers if not given(L.cost) and is_gap(L.cost_note)})
    view["misaligned"] = misaligned_rows(layers)  # audit.json files written before the ranked "alignment"
    view["gemms"] = gemm_modules(layers, ["fp32", "tf32", *formats])
    view["gemm_formats"] = [f for f in dict.fromkeys(["fp32", "tf32", *formats])  # tf32 once, when audited too
                            if any(f in r["times"] for r in view["gemms"])]
    view["has_alignment"] = any(isinstance(L.alignment, (list, tuple, Mapping)) for L in layers)
    view["alignment_gaps"] = sorted({L.alignment_note for L in layers
                                     if L.alignment is None and is_gap(L.alignment_note)})
    # the ranking (analysis/alignment.py) is derived from the per-layer records: shown only alongside them
    ranked = audit.alignment
    view["alignment"] = ranked if isinstance(ranked, R.AlignmentRanking) and view["has_alignment"] else None

    ls = audit.loss_scale if given(audit.loss_scale) else None
    units = view["grouping"].units
    # Many modules: one point per branch of the module tree (a top-level module, one repeat of a block), so the
    # chart reads by block instead of as a barcode of hundreds of modules (docs/report.md).
    by_unit = view["collapse"] and len(units) > 1
    view["charts_by_unit"] = by_unit
    view["chart_error"] = ((_unit_error_chart(layers, formats, units) if by_unit
                            else _error_chart(names, layers, formats, units)) if layers else None)
    view["chart_ranges"] = _ranges_chart(layers, units, by_unit) if layers else None
    view["chart_grad_hist"], view["grad_hist_note"] = _grad_hist_chart(layers, ls)
    all_times = [cost_times(L.cost) for L in layers]
    chart_formats = list(dict.fromkeys(f for f in ["fp32", "tf32", *formats] if any(f in t for t in all_times)))
    view["chart_time"] = (charts.time_by_layer(names, {f: [t.get(f) for t in all_times] for f in chart_formats},
                                               units=units)
                          if chart_formats else None)
    view["time_note"] = ("; ".join(view["cost_gaps"]) if view["cost_gaps"] else
                         "not measured: no layer in this audit.json has an estimated time per format")


def _policy_view(policy: Mapping[str, Any] | None) -> dict[str, Any]:
    """The policy text, embedded three ways: shown, as a JSON data block, and as a download link."""
    if policy is None:
        return {"policy_text": None, "policy_script": Markup("null"), "policy_href": None}
    text = json.dumps(policy, indent=2)
    # Inside <script>, "<" written as \u003c keeps "</script>" and "<!--" out of the raw text; JSON parses it
    # back to the same string.
    return {"policy_text": text,
            "policy_script": Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")),
            "policy_href": "data:application/json;charset=utf-8," + urllib.parse.quote(text + "\n", safe="")}


def _memory_view(memory: R.Memory) -> dict[str, Any]:
    """``memory.per_format`` as table cells (text, sort value, "not measured" note), plus advice and note. The
    columns are the fields each format's record holds, in its order (a map by nature: a later version may add
    one)."""
    per = memory.per_format
    recs = ([(str(f), to_json(rec)) for f, rec in per.items() if isinstance(rec, R.FormatMemory)]
            if isinstance(per, Mapping) else [])
    cols: list[str] = []
    for _, rec in recs:
        cols += [k for k in rec if k not in cols and not k.endswith("_note")]
    rows = []
    for f, rec in recs:
        cells = []
        for c in cols:
            x = rec.get(c)
            # "peak_gpu_bytes": null goes with "peak_note" (or "peak_gpu_note") saying why.
            note = next((rec[k] for k in (c.replace("_bytes", "_note"), c.split("_")[0] + "_note")
                         if isinstance(rec.get(k), str)), None) if x is None else None
            text = fmt_value(c, x) if x is not None else ("not measured" if note else "—")
            sort = x if is_number(x) else ""
            cells.append({"text": text, "v": sort, "note": note})
        rows.append((f, cells))
    advice: Any = memory.advice
    advice = [advice] if isinstance(advice, str) else list(advice or [])
    rest = {k: v for k, v in to_json(memory).items() if k not in ("per_format", "advice", "note")}
    return {"rows": rows, "cols": cols, "advice": advice, "note": memory.note,
            "rest": rest or None}  # every other field of the section (the template renders it generically)


# --- charts -----------------------------------------------------------------------------------------------


def _error_chart(names: list[str], layers: list[R.LayerReport], formats: list[str],
                 units: list[tuple[int, int, str]]) -> Markup:
    series = {}
    for f in formats:
        s = charts.ErrorSeries()
        for L in layers:
            e = (L.error or {}).get(f)
            loc = e.local if isinstance(e, R.LayerError) else None
            acc = e.accumulated if isinstance(e, R.LayerError) else None
            s.local.append(loc.rel_l2 if loc is not None and given(loc) else None)
            s.local_missing.append(loc is None)
            s.accumulated.append(acc.rel_l2 if acc is not None and given(acc) else None)
        series[f] = s
    return charts.error_by_layer(names, series, units=units)


def _unit_error_chart(layers: list[R.LayerReport], formats: list[str], units: list[tuple[int, int, str]]) -> Markup:
    """Per unit: the accumulated error at its own output, and the largest local error among its modules (where
    error enters inside it; a non-finite one counts as the largest)."""
    where = {L.name or "(model)": i for i, L in reversed(list(enumerate(layers)))}
    series = {}
    for f in formats:
        s = charts.ErrorSeries()
        for a, b, label in units:
            own = where.get(label)
            e = (layers[own].error or {}).get(f) if own is not None else None
            acc = e.accumulated if isinstance(e, R.LayerError) else None
            s.accumulated.append(acc.rel_l2 if acc is not None and given(acc) else None)
            vals: list[float | None] = []
            for L in layers[a:b + 1]:
                le = L.error.get(f)
                if isinstance(le, R.LayerError) and le.local is not None:
                    vals.append(le.local.rel_l2)
            finite = [v for v in vals if v is not None]
            s.local.append(None if len(finite) < len(vals) else max(finite, default=None))
            s.local_missing.append(not vals)
        series[f] = s
    names = [label for _, _, label in units]
    return charts.error_by_layer(names, series, units=[(k, k, n) for k, n in enumerate(names)])


def _hist_span(h: Any) -> tuple[float, float] | None:
    keys = [int(k) for k, v in (h or {}).items() if v and int(k) > -150]
    return (float(min(keys)), float(max(keys) + 1)) if keys else None


def _span(h: Any, amax: Any) -> tuple[float, float] | None:
    """log2 of the smallest non-zero magnitude (its histogram bucket's lower edge) and of amax."""
    lo_hi = _hist_span(h)
    if lo_hi is None or not amax or amax <= 0:
        return None
    return (lo_hi[0], math.log2(amax))


def _ranges_chart(layers: list[R.LayerReport], units: list[tuple[int, int, str]], by_unit: bool = False) -> Markup:
    rows = []
    for i, L in enumerate(layers):
        act, grad = L.activation if isinstance(L.activation, R.Activation) else None, output_gradient(L)
        a = _span(act.exponent_histogram, act.amax) if act is not None else None
        g = _span(grad.exponent_histogram, grad.amax) if grad is not None else None
        name = L.name or "(model)"
        rows.append(charts.LayerRange(
            name=name, act=a, grad=g,
            act_tip=f"#{i} {name} activations: 2^{int(a[0])} to {fmt_num(act.amax)} (amax)" if a and act else "",
            grad_tip=f"#{i} {name} output gradients: 2^{int(g[0])} to {fmt_num(grad.amax)} (amax)"
            if g and grad else ""))
    bands = [charts.Band(f.value, math.log2(SPECS[f].min_subnormal), math.log2(SPECS[f].min_normal),
                         math.log2(SPECS[f].max)) for f in BAND_FORMATS]
    if by_unit:  # one bar per unit: the smallest and largest magnitude over its modules
        return charts.ranges(_unit_ranges(rows, units), bands, units=[(k, k, u[2]) for k, u in enumerate(units)])
    return charts.ranges(rows, bands, units=units)


def _envelope(spans: list[tuple[float, float]]) -> tuple[float, float] | None:
    return (min(x[0] for x in spans), max(x[1] for x in spans)) if spans else None


def _unit_ranges(rows: list[charts.LayerRange], units: list[tuple[int, int, str]]) -> list[charts.LayerRange]:
    out = []
    for first, last, label in units:
        part = rows[first:last + 1]
        act = _envelope([r.act for r in part if r.act])
        grad = _envelope([r.grad for r in part if r.grad])
        out.append(charts.LayerRange(
            name=label, act=act, grad=grad,
            act_tip=f"{label} ({last - first + 1} modules) activations: 2^{int(act[0])} to 2^{act[1]:.1f}"
            if act else "",
            grad_tip=f"{label} output gradients: 2^{int(grad[0])} to 2^{grad[1]:.1f}" if grad else ""))
    return out


def _grad_hist_chart(layers: list[R.LayerReport], ls: R.LossScale | None) -> tuple[Markup | None, str]:
    counts: dict[int, int] = {}
    used = [L for L in layers if L.is_leaf is not False] or layers  # a file without is_leaf: every layer
    for L in used:
        grad = output_gradient(L)
        h = (grad.exponent_histogram if grad is not None else None) or {}
        for k, v in h.items():
            counts[int(k)] = counts.get(int(k), 0) + int(v)
    if not counts:
        return None, "not measured: no output-gradient histograms in this audit.json (the loss had no gradient)"
    fp16 = SPECS[Format.FP16]
    sub, normal, top = math.log2(fp16.min_subnormal), math.log2(fp16.min_normal), math.log2(fp16.max)
    markers = [charts.Marker(sub, "FP16 flush, scale 1",
                             f"Below FP16's smallest subnormal 2^{int(sub)} at loss scale 1, gradients flush to zero "
                             "(half of it and below) or lose most of their digits", "marker flush"),
               charts.Marker(normal, "FP16 subnormal, scale 1",
                             f"Below 2^{int(normal)} FP16 values are subnormal (fewer significant bits) "
                             "at loss scale 1",
                             "marker sub")]
    exp: Any = ls.recommended_exponent if ls else None
    if exp is None and ls and ls.recommended_init_scale:
        exp = math.log2(ls.recommended_init_scale)
    if exp:
        markers.append(charts.Marker(sub - exp, f"FP16 flush, scale 2^{int(exp)}",
                                     f"At the recommended loss scale 2^{int(exp)}, gradients below 2^{int(sub - exp)} "
                                     "still underflow in FP16", "marker flush-rec"))
        markers.append(charts.Marker(top - exp, f"FP16 overflow, scale 2^{int(exp)}",
                                     f"At loss scale 2^{int(exp)}, gradients above {fp16.max:.0f} / "
                                     f"2^{int(exp)} overflow",
                                     "marker overflow"))
    note = (f"Output gradients of {len(used)} leaf module(s), summed, from the FP32 reference backward pass."
            if len(used) != len(layers) else f"Output gradients of {len(used)} module(s), summed.")
    return charts.exponent_histogram(counts, markers), note


__all__ = ["BAND_FORMATS", "SECTIONS", "build_view"]
