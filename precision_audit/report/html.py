"""report.html: one self-contained page rendered by jinja2 (autoescape on) from the finished audit.json.

The report computes nothing: it picks numbers out of audit.json, formats them for people and draws them
(:mod:`precision_audit.report.charts`). The ``audit`` dict is its only input besides the policy, so
``precision-audit report audit.json`` re-renders the same page byte for byte; the one thing that differs is
the generation timestamp in ``<time id="generated">``.

Fields a reader of audit.json cannot count on (per layer ``alignment`` and ``cost``; ``summary.<format>.step_time.
estimated_s``; top-level ``estimates``, ``memory``, ``traces`` and ``verify``; the planner's fields in ``plan``)
are shown when present and otherwise replaced by the matching ``*_note`` ("not measured: <why>"); the
shapes read are listed in docs/report.md.

Example::

    html = render_html(json.load(open("audit/audit.json")), json.load(open("audit/policy.json")))
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import urllib.parse
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import jinja2
from markupsafe import Markup, escape

from ..formats import RANGE_FORMATS, SPECS, Format
from ..record import AuditRecord  # noqa: F401  (the type render_html takes)
from . import charts
from .numbers import _label, fmt_bytes, fmt_db, fmt_num, fmt_pct, fmt_scale, fmt_seconds, fmt_value, severity  # noqa: F401

TEMPLATE = "report.html.j2"

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


def _loader() -> jinja2.BaseLoader:
    root = resources.files("precision_audit.templates")

    def load(name: str) -> str | None:
        f = root.joinpath(name)
        return f.read_text(encoding="utf-8") if f.is_file() else None

    return jinja2.FunctionLoader(load)


# --- generic rendering for fields this version does not know by name ---------------------------------------


def generic_html(value: Any, key: str = "", depth: int = 0) -> Markup:
    """Render a JSON value as HTML: dicts as <dl>, lists of dicts as a table, scalars formatted by key."""
    if isinstance(value, Mapping):
        if not value:
            return Markup('<span class="muted">none</span>')
        rows = [Markup("<dt>{}</dt><dd>{}</dd>").format(_label(str(k)), generic_html(v, str(k), depth + 1))
                for k, v in value.items()]
        return Markup('<dl class="facts">') + Markup("").join(rows) + Markup("</dl>")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value) and depth < 4:
        cols: list[str] = []
        for v in value:
            cols += [str(k) for k in v if str(k) not in cols]
        head = Markup("").join(Markup('<th scope="col" title="{}">{}</th>').format(c, _label(c)) for c in cols)
        body = Markup("").join(
            Markup("<tr>") + Markup("").join(Markup("<td>{}</td>").format(fmt_value(c, v.get(c))) for c in cols)
            + Markup("</tr>") for v in value)
        return Markup('<table class="generic"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>').format(head, body)
    return escape(fmt_value(key, value))


# --- picking the optional fields --------------------------------------------------------------------------


def _pick(d: Any, *keys: str) -> Any:
    """The first of ``keys`` present (and not None) in dict ``d``."""
    if not isinstance(d, Mapping):
        return None
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def _is_gap(note: Any) -> bool:
    """Whether a ``*_note`` says something was not measured (rather than, say, "no computation of its own")."""
    return isinstance(note, str) and note.lower().startswith(("not measured", "not estimated", "not available"))


def cost_times(cost: Any, formats: Sequence[str] | None = None, kind: str = "estimated") -> dict[str, float]:
    """Per-format times (seconds) from a layer's ``cost`` record: ``cost.estimated_step_time_s`` (the
    target estimate) or, with ``kind="measured"``, ``cost.measured_forward_time_s``. ``formats`` None: all."""
    if not isinstance(cost, Mapping):
        return {}
    keys = (("estimated_step_time_s", "estimated_s") if kind == "estimated"
            else ("measured_forward_time_s", "measured_s"))
    flat = _pick(cost, *keys)
    if not isinstance(flat, Mapping):
        return {}
    return {str(f): float(t) for f, t in flat.items()
            if (formats is None or f in formats) and isinstance(t, (int, float)) and not isinstance(t, bool)}


def alignment_findings(alignment: Any) -> list[dict[str, Any]]:
    """A layer's alignment records (one per GEMM/conv/attention op that ran): a list, or ``{"findings": [...]}``."""
    if isinstance(alignment, Mapping):
        alignment = _pick(alignment, "findings", "ops")
    if isinstance(alignment, (list, tuple)):
        return [dict(a) for a in alignment if isinstance(a, Mapping)]
    return []


def misaligned_rows(layers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per misaligned dimension of an op that ran (the same dim for several formats is one row)."""
    rows = []
    for i, L in enumerate(layers):
        for op in alignment_findings(L.get("alignment")):
            groups: dict[tuple, list[Mapping[str, Any]]] = {}
            for d in op.get("dims") or []:
                if isinstance(d, Mapping) and d.get("aligned") is False:
                    key = (d.get("dim"), d.get("size"), d.get("required_multiple"), d.get("suggested_size"))
                    groups.setdefault(key, []).append(d)
            for (dim, size, multiple, suggested), ds in groups.items():
                fmts = [str(d.get("format")) for d in ds]
                saving = op.get("estimated_saving_s") or {}
                rows.append({
                    "index": i, "module": L.get("name") or "(model)", "op": op.get("op"), "kind": op.get("kind"),
                    "gemm": op.get("gemm") or {}, "calls": op.get("calls"), "dim": dim, "dim_name": ds[0].get("name"),
                    "size": size, "formats": fmts, "multiple": multiple, "suggested": suggested,
                    "efficient_multiple": ds[0].get("efficient_multiple"),
                    "efficient_size": ds[0].get("efficient_size"),
                    "tile_waste_pct": ds[0].get("tile_waste_pct"), "cost": ds[0].get("cost"),
                    "saving": {f: saving.get(f) for f in fmts
                               if isinstance(saving, Mapping) and saving.get(f) is not None},
                    "measured": op.get("measured"), "note": op.get("note")})
    return rows


def gemm_rows(layers: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every GEMM/conv/attention op that ran, with its shape, FLOPs and estimated time per format."""
    rows = []
    for i, L in enumerate(layers):
        for op in alignment_findings(L.get("alignment")):
            dims = [d for d in op.get("dims") or [] if isinstance(d, Mapping)]
            bad = sorted({f"{d.get('dim')}={d.get('size')}" for d in dims if d.get("aligned") is False})
            below = sorted({f"{d.get('dim')}={d.get('size')}" for d in dims
                            if d.get("aligned") and d.get("efficient_size") not in (None, d.get("size"))})
            rows.append({"index": i, "module": L.get("name") or "(model)", "op": op.get("op"),
                         "kind": op.get("kind"), "gemm": op.get("gemm") or {}, "calls": op.get("calls"),
                         "flops": op.get("flops"), "times": op.get("estimated_step_time_s") or {},
                         "padded": op.get("estimated_padded_step_time_s") or {}, "misaligned": bad,
                         "below_tier": below, "note": op.get("note")})
    return rows


def loss_curve_series(verify: Any) -> dict[str, list[float | None]]:
    """Loss curves from ``verify``: ``curves``/``loss_curves``/``losses``/``runs`` mapping a run name to a
    list of losses or to a record with ``losses``/``loss``."""
    src = _pick(verify, "curves", "loss_curves", "losses", "runs")
    out: dict[str, list[float | None]] = {}
    if isinstance(src, Mapping):
        for name, v in src.items():
            if isinstance(v, Mapping):
                v = _pick(v, "losses", "loss", "curve")
            if isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (int, float)) for x in v):
                out[str(name)] = [None if x is None else float(x) for x in v]
    elif isinstance(src, (list, tuple)):
        for v in src:
            losses = _pick(v, "losses", "loss")
            if isinstance(losses, (list, tuple)):
                out[str(_pick(v, "name", "run", "label"))] = [None if x is None else float(x) for x in losses]
    return out


def _note(audit: Mapping[str, Any], key: str, default: str) -> str:
    n = audit.get(f"{key}_note")
    return n if isinstance(n, str) and n else default


# --- the view model ---------------------------------------------------------------------------------------


def build_view(audit: Mapping[str, Any], policy: Mapping[str, Any] | None) -> dict[str, Any]:
    """Everything the template shows that is more than one field: picked, labelled, and charted."""
    formats: list[str] = list(audit.get("formats") or [])
    summary = audit.get("summary") or {}
    layers = audit.get("layers") or []
    plan = audit.get("plan") or {}
    target = audit.get("target") or {}
    ls = audit.get("loss_scale")
    estimates: Any = audit.get("estimates") if isinstance(audit.get("estimates"), Mapping) else {}
    names = [L.get("name", "") for L in layers]
    all_formats = ["fp32", *formats]

    view: dict[str, Any] = {"sections": SECTIONS, "formats": formats}
    view["headline"] = _headline(audit, formats, summary, plan, target, ls)
    view["predicted_rel"] = relative_to_fp32(plan.get("predicted_loss_change"), summary)
    view["warnings"] = _warnings(audit, formats, summary, layers)

    # Per-format step times: estimated on the target (the headline) and measured where the audit ran.
    view["speedup"] = {f: speedup(audit, f) for f in all_formats}
    view["has_estimates"] = any(((summary.get(f) or {}).get("step_time") or {}).get("estimated_s") is not None
                                for f in all_formats)
    skipped = {x.get("format") for x in audit.get("formats_skipped") or []}
    est_steps = estimates.get("step_time_s") if isinstance(estimates.get("step_time_s"), Mapping) else {}
    view["estimate_only"] = [(f, t, speedup(audit, f)) for f, t in est_steps.items()
                             if f not in all_formats and f not in skipped]
    view["estimate_assumptions"] = list(estimates.get("assumptions") or [])

    # Layer costs and alignment.
    view["layer_times"] = [cost_times(L.get("cost"), all_formats) for L in layers]
    view["has_cost"] = any(L.get("cost") for L in layers)
    view["cost_gaps"] = sorted({L["cost_note"] for L in layers if not L.get("cost") and _is_gap(L.get("cost_note"))})
    view["misaligned"] = misaligned_rows(layers)  # audit.json files written before the ranked "alignment"
    view["gemms"] = gemm_rows(layers)
    view["gemm_formats"] = [f for f in dict.fromkeys(["fp32", "tf32", *formats])  # tf32 once, when audited too
                            if any(f in r["times"] for r in view["gemms"])]
    view["has_alignment"] = any(isinstance(L.get("alignment"), (list, tuple, Mapping)) for L in layers)
    view["alignment_gaps"] = sorted({L["alignment_note"] for L in layers
                                     if L.get("alignment") is None and _is_gap(L.get("alignment_note"))})
    # the ranking (analysis/alignment.py) is derived from the per-layer records: shown only alongside them
    ranked = audit.get("alignment")
    view["alignment"] = ranked if isinstance(ranked, Mapping) and view["has_alignment"] else None

    # Charts.
    view["chart_error"] = _error_chart(names, layers, formats) if layers else None
    view["chart_ranges"] = _ranges_chart(layers) if layers else None
    view["chart_grad_hist"], view["grad_hist_note"] = _grad_hist_chart(layers, ls)
    all_times = [cost_times(L.get("cost")) for L in layers]
    chart_formats = [f for f in ["fp32", "tf32", *formats] if any(f in t for t in all_times)]
    chart_formats = list(dict.fromkeys(chart_formats))
    view["chart_time"] = (charts.time_by_layer(names, {f: [t.get(f) for t in all_times] for f in chart_formats})
                          if chart_formats else None)
    view["time_note"] = ("; ".join(view["cost_gaps"]) if view["cost_gaps"] else
                         "not measured: no layer in this audit.json has an estimated time per format")

    verify = audit.get("verify")
    curves = loss_curve_series(verify) if verify else {}
    view["chart_verify"] = charts.loss_curves(curves) if curves else None
    view["verify_rest"] = ({k: v for k, v in verify.items() if k not in ("curves", "loss_curves", "losses", "runs")}
                           if isinstance(verify, Mapping) else None)
    view["verify_note"] = _note(audit, "verify", "not measured: this audit.json has no A/B training run "
                                                 "(precision-audit verify trains one)")

    memory = audit.get("memory")
    view["memory"] = _memory_view(memory) if isinstance(memory, Mapping) and memory else None
    view["memory_note"] = _note(audit, "memory", "not measured: this audit.json has no memory figures")
    from ..fp8.report import fp8_view  # the FP8 section (issue 16, docs/fp8.md)
    view["fp8"] = fp8_view(audit)

    view.update(_policy_view(policy))
    return view


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


def _memory_view(memory: Mapping[str, Any]) -> dict[str, Any]:
    """``memory.per_format`` as table cells (text, sort value, "not measured" note), plus advice and note."""
    per = memory.get("per_format")
    recs = [(str(f), rec) for f, rec in per.items() if isinstance(rec, Mapping)] if isinstance(per, Mapping) else []
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
            sort = x if isinstance(x, (int, float)) and not isinstance(x, bool) else ""
            cells.append({"text": text, "v": sort, "note": note})
        rows.append((f, cells))
    advice = memory.get("advice")
    advice = [advice] if isinstance(advice, str) else list(advice or [])
    rest = {k: v for k, v in memory.items() if k not in ("per_format", "advice", "note")}
    return {"rows": rows, "cols": cols, "advice": advice, "note": memory.get("note"),
            "rest": generic_html(rest) if rest else None}


def speedup(audit: Mapping[str, Any], f: str) -> float | None:
    """Estimated speedup of the all-``f`` step over fp32 on the target: ``estimates.speedup_vs_fp32`` (or
    the ratio of the two ``summary.<f>.step_time.estimated_s``)."""
    est = audit.get("estimates")
    sp = (est.get("speedup_vs_fp32") or {}).get(f) if isinstance(est, Mapping) else None
    if isinstance(sp, (int, float)):
        return float(sp)
    summary = audit.get("summary") or {}
    ref = ((summary.get("fp32") or {}).get("step_time") or {}).get("estimated_s")
    mine = ((summary.get(f) or {}).get("step_time") or {}).get("estimated_s")
    if not (ref and mine):
        return None
    ratio = ref / mine
    return ratio if math.isfinite(ratio) else None  # 1e308 / 5e-324 overflows: no speedup to show


def relative_to_fp32(change: Any, summary: Mapping[str, Any]) -> float | None:
    """An absolute loss change (the loss's own units) as a change relative to the FP32 loss, the basis of every
    other loss change the report shows; None when the FP32 loss is 0, absent or the quotient overflows."""
    ref = (summary.get("fp32") or {}).get("loss") if isinstance(summary, Mapping) else None
    if not isinstance(change, (int, float)) or not isinstance(ref, (int, float)) or not ref:
        return None
    rel = abs(change) / abs(ref)
    return rel if math.isfinite(rel) else None


def _override_groups(plan: Mapping[str, Any]) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, o in (plan.get("overrides") or {}).items():
        groups.setdefault(o.get("format", "?"), []).append(name or "(model)")
    return groups


def _headline(audit, formats, summary, plan, target, ls) -> dict[str, Any]:
    d = plan.get("default_format", "fp32")
    groups = _override_groups(plan)
    keep = []
    for fmt, mods in groups.items():
        shown = ", ".join(mods[:4]) + (f" and {len(mods) - 4} more" if len(mods) > 4 else "")
        keep.append(f"{len(mods)} module{'s' if len(mods) != 1 else ''} in {fmt} ({shown})")
    if not formats:
        sentence = "No low-precision format was audited: keep training in fp32."
    else:
        sentence = (f"Train with {d} autocast by default" + (", keeping " + "; ".join(keep) if keep else "")
                    + (f" on {target.get('name')}" if target.get("name") else "") + ".")
    h: dict[str, Any] = {"sentence": sentence, "default": d,
                         "unsafe": (audit.get("verdict") or {}).get("exit_code") == 1}

    # Estimated speedup of the default format over fp32 on the target.
    sp = speedup(audit, d) if d != "fp32" else None
    if sp is not None:
        h["speedup"] = (f"{sp:.2f}× for an all-{d} step over fp32 (estimate from the cost model"
                        + (", before the plan's overrides" if groups else "") + ")")
        h["speedup_ok"] = True
    else:
        st = (summary.get(d) or summary.get("fp32") or {}).get("step_time") or {}
        note = st.get("estimated_note")
        h["speedup"] = note if _is_gap(note) else "not measured: no estimated step time in this audit.json"
        h["speedup_ok"] = False

    # Expected loss change: measured with the plan applied (its verification pass), the planner's first-order
    # prediction, and (without a verification) the all-default-format pass.
    parts = []
    ver = plan.get("verification") if isinstance(plan.get("verification"), Mapping) else {}
    budget_rel = ((audit.get("options") or {}).get("budget") or {}).get("max_loss_rel_change")
    if isinstance(ver.get("loss_rel_change"), (int, float)):
        within = ver.get("within_budget")
        parts.append(f"measured {fmt_num(ver['loss_rel_change'])} relative to FP32 with the plan applied "
                     f"({ver.get('source') or 'verification pass'}"
                     + (f"; budget {fmt_num(budget_rel)}" if budget_rel is not None else "")
                     + ("" if within is None else ", within it" if within else ", over it") + ")")
    elif ver.get("error"):
        parts.append(f"the verification pass failed: {ver['error']}")
    if isinstance(plan.get("predicted_loss_rel_change"), (int, float)):
        parts.append(f"predicted {fmt_num(plan['predicted_loss_rel_change'])} (first-order, calibrated against the "
                     "all-format passes)")
    elif isinstance(plan.get("predicted_loss_change"), (int, float)):
        # like with like: the measured figures beside it are relative to the FP32 loss, so this one is too
        rel = relative_to_fp32(plan["predicted_loss_change"], summary)
        if rel is not None:
            parts.append(f"predicted {fmt_num(rel)} relative to FP32 for the plan (first-order, uncalibrated)")
        else:
            parts.append(f"predicted {fmt_num(plan['predicted_loss_change'])} for the plan in the loss's own units "
                         "(first-order; not comparable with a relative change: the FP32 loss is 0 or not finite)")
    s = summary.get(d) or {}
    if d != "fp32" and "loss_rel_change" in s and not ver:
        parts.append(f"measured {fmt_num(s.get('loss_rel_change'))} relative to FP32 in the all-{d} pass"
                     + (f" (budget {fmt_num(budget_rel)})" if budget_rel is not None else ""))
    h["loss_ok"] = ver.get("within_budget") is not False and not ver.get("error")
    h["loss"] = "; ".join(parts) if parts else (
        "none: the plan keeps fp32" if d == "fp32" else "not measured: no pass in the default format")

    # FP16.
    skipped = {x.get("format"): x.get("reason") for x in audit.get("formats_skipped") or []}
    if "fp16" in formats and ls:
        if ls.get("viable"):
            gd = ls.get("gradscaler_default") or {}
            extra = ""
            if gd.get("skipped_steps") is not None:
                extra = (f"; torch.amp.GradScaler's defaults (init {fmt_scale(gd.get('init_scale'))}) skip "
                         f"{gd.get('skipped_steps')} step(s) at the start")
            h["fp16"] = f"viable with loss scale {fmt_scale(ls.get('recommended_init_scale'))}{extra}"
            h["fp16_ok"] = True
        else:
            h["fp16"] = f"not viable as is: {ls.get('reason', '')}"
            h["fp16_ok"] = False
    elif "fp16" in skipped:
        h["fp16"], h["fp16_ok"] = skipped["fp16"], False
    else:
        h["fp16"], h["fp16_ok"] = "not measured: fp16 was not among the audited formats", False
    return h


def _warnings(audit, formats, summary, layers) -> list[str]:
    """audit.json's warnings, then every "not measured" note, each once."""
    w: list[str] = list(audit.get("warnings") or [])
    for s in audit.get("formats_skipped") or []:
        w.append(f"{s.get('format')}: {s.get('reason')}")
    notes: list[str] = []
    for f in ["fp32", *formats]:
        st = (summary.get(f) or {}).get("step_time") or {}
        for k, what in (("measured_note", "measured step time"), ("estimated_note", "estimated step time")):
            if _is_gap(st.get(k)):
                notes.append(f"{what}: {st[k]}")
    for key, what in (("alignment", "Tensor Core alignment"), ("cost", "per-layer cost")):
        notes += [f"{what}: {L[key + '_note']}" for L in layers if not L.get(key) and _is_gap(L.get(key + "_note"))]
    local_missing: dict[str, list[str]] = {}
    for L in layers:
        for e in (L.get("error") or {}).values():
            if isinstance(e, Mapping) and e.get("local") is None and e.get("local_note"):
                local_missing.setdefault(e["local_note"], []).append(L.get("name") or "(model)")
    for note, mods in local_missing.items():
        uniq = list(dict.fromkeys(mods))
        notes.append(f"local error not measured for {', '.join(uniq[:5])}{' …' if len(uniq) > 5 else ''}: {note}")
    memory = audit.get("memory") if isinstance(audit.get("memory"), Mapping) else {}
    for rec in (memory.get("per_format") or {}).values():
        if isinstance(rec, Mapping) and _is_gap(rec.get("peak_note")):
            notes.append(f"peak GPU memory: {rec['peak_note']}")
    for key, what in (("verify", "A/B training run (precision-audit verify)"), ("memory", "memory per format"),
                      ("estimates", "step-time estimates")):
        if not audit.get(key):
            notes.append(f"{what}: " + _note(audit, key, "not measured: not in this audit.json"))
    for n in notes:
        if n not in w:
            w.append(n)
    return w


def _error_chart(names, layers, formats) -> Markup:
    series = {}
    for f in formats:
        s = charts.ErrorSeries()
        for L in layers:
            e = (L.get("error") or {}).get(f) or {}
            loc, acc = e.get("local"), e.get("accumulated")
            s.local.append(loc.get("rel_l2") if loc else None)
            s.local_missing.append(loc is None)
            s.accumulated.append(acc.get("rel_l2") if acc else None)
        series[f] = s
    return charts.error_by_layer(names, series)


def _hist_span(h: Any) -> tuple[float, float] | None:
    keys = [int(k) for k, v in (h or {}).items() if v and int(k) > -150]
    return (float(min(keys)), float(max(keys) + 1)) if keys else None


def _span(h: Any, amax: Any) -> tuple[float, float] | None:
    """log2 of the smallest non-zero magnitude (its histogram bucket's lower edge) and of amax."""
    lo_hi = _hist_span(h)
    if lo_hi is None or not amax or amax <= 0:
        return None
    return (lo_hi[0], math.log2(amax))


def _ranges_chart(layers) -> Markup:
    rows = []
    for i, L in enumerate(layers):
        act, grad = L.get("activation") or {}, ((L.get("gradient") or {}).get("output") or {})
        a = _span(act.get("exponent_histogram"), act.get("amax"))
        g = _span(grad.get("exponent_histogram"), grad.get("amax"))
        name = L.get("name") or "(model)"
        rows.append(charts.LayerRange(
            name=name, act=a, grad=g,
            act_tip=f"#{i} {name} activations: 2^{int(a[0])} to {fmt_num(act.get('amax'))} (amax)" if a else "",
            grad_tip=f"#{i} {name} output gradients: 2^{int(g[0])} to {fmt_num(grad.get('amax'))} (amax)" if g else ""))
    bands = [charts.Band(f.value, math.log2(SPECS[f].min_subnormal), math.log2(SPECS[f].min_normal),
                         math.log2(SPECS[f].max)) for f in BAND_FORMATS]
    return charts.ranges(rows, bands)


def _grad_hist_chart(layers, ls) -> tuple[Markup | None, str]:
    counts: dict[int, int] = {}
    used = [L for L in layers if L.get("is_leaf", True)] or layers
    for L in used:
        h = ((L.get("gradient") or {}).get("output") or {}).get("exponent_histogram") or {}
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
    exp = ls.get("recommended_exponent") if ls else None
    if exp is None and ls and ls.get("recommended_init_scale"):
        exp = math.log2(ls["recommended_init_scale"])
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


# --- rendering --------------------------------------------------------------------------------------------


def _asset(name: str) -> Markup:
    """A CSS or JS file from templates/, inlined verbatim (not parsed as a template)."""
    return Markup(resources.files("precision_audit.templates").joinpath(name).read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=_loader(), autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(num=fmt_num, pct=fmt_pct, db=fmt_db, seconds=fmt_seconds, bytes=fmt_bytes,
                       scale=fmt_scale, value=lambda v, key="": fmt_value(key, v), generic=generic_html, label=_label)
    env.globals.update(severity=severity, isfinite=lambda x: x is not None and math.isfinite(x),
                       series_class=charts.series_class, fmt_value=fmt_value, asset=_asset)
    return env


def render_html(audit: AuditRecord | Mapping[str, Any], policy: Mapping[str, Any] | None,
                generated: _dt.datetime | None = None) -> str:
    """The report page of the audit's record (or of audit.json's content, already validated). ``policy`` None
    shows "not available"; ``generated`` defaults to now (UTC).

    The page is drawn from the record written out as audit.json (report/audit_json.py ``as_document``): it
    shows every field of the file, those a later version adds included, and reads the older field names it has
    always read (docs/report.md), so one audit.json renders the same page from the audit and from
    ``precision-audit report``. Everything but the ``<time id="generated">`` element is a function of ``audit``
    and ``policy``.
    """
    from .audit_json import as_document

    doc: Mapping[str, Any] = as_document(audit)
    when = (generated or _dt.datetime.now(_dt.timezone.utc)).isoformat(timespec="seconds")
    view = build_view(doc, policy)
    return _env().get_template(TEMPLATE).render(a=doc, v=view, policy=policy, generated=when)
