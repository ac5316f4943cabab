"""The report's views for models with many modules (docs/report.md, "Models with hundreds of layers"): the layers
grouped by repeated block with the spread across repeats, the plan by decision, the GEMMs by module, and the
decision in words (every module off the default format, FP8 included, and the rule that chose between formats of
equal estimate).

View logic only: every figure is a field of the audit's typed record (precision_audit/record/__init__.py); this module
picks them, orders them and says which repeat holds the worst (report/groups.py finds the repeats).

Example::

    g = grouping(record.layers)
    rows = layer_rows(record, g, record.formats)
    moves = off_default(record, g)      # [("fp32", ["hot"], 1), ("fp8_tensorwise", ["blocks.*.attn.c_attn"], 2)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .. import record as R
from ..record.fp8 import Fp8, Fp8ModulePlan, Fp8PlanReport
from .groups import Group, Grouping, Spread, compress_names, spread
from .numbers import fmt_num, fmt_seconds, severity
from .picks import alignment_findings, cost_times, output_gradient

#: The planner's tie rule, as docs/plan.md states it: estimated times closer than this (relative) are equal, and
#: between equals fewer overrides win, then no loss scaling, then this order of default formats. The report may
#: not import the planner (it renders a finished record), so tests/report/test_grouped_views.py checks that these
#: equal planning/select.py's TIME_TIE and planning/planner.py's FORMAT_PREFERENCE.
TIME_TIE = 1e-9
FORMAT_ORDER = ("bf16", "fp16", "tf32", "fp32")
TIE_RULE = ("between estimates equal to one part in 10^9: fewer overrides, then no loss scaling, then the order "
            "bf16, fp16, tf32, fp32 (docs/plan.md)")

# --- per-module figures -------------------------------------------------------------------------------------


def _local(L: R.LayerReport, f: str) -> R.ErrorMetrics | None:
    e = L.error.get(f)
    return e.local if isinstance(e, R.LayerError) else None


def _accum(L: R.LayerReport, f: str) -> R.ErrorMetrics | None:
    e = L.error.get(f)
    return e.accumulated if isinstance(e, R.LayerError) else None


def _headroom(L: R.LayerReport) -> float | None:
    act = L.activation if isinstance(L.activation, R.Activation) else None
    v = (act.headroom_bits or {}).get("fp16") if act is not None else None
    return v if isinstance(v, (int, float)) else None


def _amax(L: R.LayerReport) -> float | None:
    act = L.activation if isinstance(L.activation, R.Activation) else None
    return act.amax if act is not None and isinstance(act.amax, (int, float)) else None


def _grad_flushed(L: R.LayerReport) -> float | None:
    go = output_gradient(L)
    un = go.fp16.unscaled if go is not None and go.fp16 is not None else None
    v = (un or {}).get("flushed") if isinstance(un, Mapping) else None
    return v if isinstance(v, (int, float)) else None


def columns(formats: Sequence[str]) -> list[dict[str, str]]:
    """The grouped table's figure columns: key, header, tooltip."""
    cols = []
    for f in formats:
        cols.append({"key": f"{f}:local", "head": f"{f} local",
                     "title": f"{f} local error (relative L2; this module alone in {f} on its FP32 inputs): median "
                              "over the repeats, the range below, outliers named"})
        cols.append({"key": f"{f}:accumulated", "head": f"{f} accum.",
                     "title": f"{f} accumulated error (relative L2; its output in the all-{f} run): median over the "
                              "repeats, the range below, outliers named"})
    cols += [{"key": "amax", "head": "act. amax", "title": "Largest |output| (FP32 run): median over the repeats"},
             {"key": "headroom", "head": "fp16 headroom (bits)",
              "title": "log2(65504 / act. amax): median over the repeats; the lowest is the worst"},
             {"key": "flushed", "head": "grad flushed (scale 1)",
              "title": "Share of output gradients that flush to zero in FP16 at loss scale 1: median over the repeats"}]
    return cols


def _figure(L: R.LayerReport, key: str) -> tuple[float | None, bool]:
    """(value, present): present False when the record has no such figure for the module."""
    if ":" in key:
        f, kind = key.split(":")
        m = _local(L, f) if kind == "local" else _accum(L, f)
        return (m.rel_l2 if m is not None else None), m is not None
    v = {"amax": _amax, "headroom": _headroom, "flushed": _grad_flushed}[key](L)
    return v, v is not None


def _text(key: str, v: float | None) -> str:
    if v is None:
        return "inf/NaN" if ":" in key else "—"
    if key == "flushed":
        return f"{v * 100:.3g}%"
    return fmt_num(v)


def _cls(key: str, v: float | None) -> str:
    if ":" in key:
        return severity(v, key.split(":")[0])
    if key == "headroom" and v is not None and v < 1:
        return "bad" if v < 0 else "warn"
    if key == "flushed" and v is not None and v > 0.01:
        return "warn"
    return ""


def _single_cell(L: R.LayerReport, key: str) -> dict[str, Any]:
    v, present = _figure(L, key)
    if not present and ":" in key:
        return {"text": "—", "v": "", "cls": "muted", "sub": "", "odd": ""}
    return {"text": _text(key, v), "v": "" if v is None else v, "cls": _cls(key, v) if present else "muted",
            "sub": "", "odd": ""}


def _spread_cell(layers: Sequence[R.LayerReport], g: Group, path: str, key: str) -> dict[str, Any]:
    vals: list[tuple[str, float | None]] = []
    nonfinite = []
    for m in g.members:
        i = g.index.get((m, path))
        if i is None:
            continue
        v, present = _figure(layers[i], key)
        if present and v is None and ":" in key:
            nonfinite.append(g.short(m))
        vals.append((g.short(m), v))
    worse = "low" if key == "headroom" else "high"
    s: Spread | None = spread(vals, worse=worse, bits=key == "headroom")
    if s is None:
        text = "inf/NaN" if nonfinite else "—"
        return {"text": text, "v": "", "cls": "bad" if nonfinite else "muted", "sub": "", "odd": ""}
    worst_v = s.lo if worse == "low" else s.hi
    sub = "" if s.lo == s.hi else f"{_text(key, s.lo)} – {_text(key, s.hi)}, worst {s.worst}"
    odd = [*nonfinite[:3], *s.outliers][:3]
    more = s.more + max(0, len(nonfinite) - 3)
    odd_text = ("outliers: " + ", ".join(odd) + (f" and {more} more" if more else "")) if odd else ""
    if nonfinite:
        odd_text = f"inf/NaN in {len(nonfinite)}; " + odd_text
    return {"text": _text(key, s.median), "v": s.median, "cls": "bad" if nonfinite else _cls(key, worst_v),
            "sub": sub, "odd": odd_text}


def _plan_text(layers: Sequence[R.LayerReport], g: Group, path: str) -> str:
    by: dict[str, list[str]] = {}
    for m in g.members:
        i = g.index.get((m, path))
        if i is not None:
            by.setdefault(str(layers[i].plan.format), []).append(g.short(m))
    if len(by) == 1:
        (f, ms), = by.items()
        return f"{f} ×{len(ms)}"
    main = max(by, key=lambda f: len(by[f]))
    rest = "; ".join(f"{f}: {', '.join(ms[:4])}{' …' if len(ms) > 4 else ''}" for f, ms in by.items() if f != main)
    return f"{main} ×{len(by[main])}; {rest}"


def layer_rows(audit: R.AuditRecord, g: Grouping, formats: Sequence[str]) -> list[dict[str, Any]]:
    """The grouped layers table, in execution order: a module outside every group is one row with its figures;
    a group is a header row and one row per path inside its repeats, each figure the median over the repeats
    with the range, the worst repeat and the outliers."""
    layers = audit.layers
    keys = [c["key"] for c in columns(formats)]
    rows: list[dict[str, Any]] = []
    started: set[str] = set()
    for i, L in enumerate(layers):
        hit = g.placed.get(i)
        if hit is None:
            rows.append({"kind": "module", "i": i, "name": L.name or "(model)", "type": L.type,
                         "cells": [_single_cell(L, k) for k in keys], "plan": str(L.plan.format),
                         "reason": L.plan.reason or ""})
            continue
        grp = hit[0]
        if grp.gid in started:
            continue
        started.add(grp.gid)
        rows.append({"kind": "group", "gid": grp.gid, "label": grp.label, "type": grp.type,
                     "repeats": len(grp.members), "paths": len(grp.paths),
                     "first": grp.members[0], "last": grp.members[-1]})
        for p in grp.paths:
            col = grp.column(p)
            if not col:
                continue
            rows.append({"kind": "path", "gid": grp.gid, "path": p, "name": grp.name(p),
                         "type": layers[col[0]].type, "repeats": len(col),
                         "cells": [_spread_cell(layers, grp, p, k) for k in keys],
                         "plan": _plan_text(layers, grp, p)})
    return rows


def layer_tags(g: Grouping, n: int) -> list[dict[str, str]]:
    """Per layer, the group and path it belongs to (the full table's rows carry them, so a group row can show
    its repeats)."""
    out = [{"gid": "", "path": ""} for _ in range(n)]
    for i, (grp, _m, p) in g.placed.items():
        out[i] = {"gid": grp.gid, "path": p}
    return out


# --- the plan, by decision ----------------------------------------------------------------------------------


def plan_summary(audit: R.AuditRecord, g: Grouping, names_shown: int = 8) -> list[dict[str, Any]]:
    """One row per (format, reason) of the plan: how many modules, and which (repeats written once)."""
    by: dict[tuple[str, str], list[str]] = {}
    for L in audit.layers:
        by.setdefault((str(L.plan.format), L.plan.reason or ""), []).append(L.name or "(model)")
    rows = []
    for (f, reason), names in by.items():
        short = compress_names(names, g)
        rows.append({"format": f, "reason": reason, "count": len(names), "names": short[:names_shown],
                     "more": max(0, len(short) - names_shown)})
    return rows


# --- GEMMs by module ----------------------------------------------------------------------------------------


def gemm_modules(layers: Sequence[R.LayerReport], formats: Sequence[str]) -> list[dict[str, Any]]:
    """Every module that ran a GEMM, convolution or attention of its own (``cost.gemm_ops``; or an alignment
    record): its GEMM count and FLOPs, its estimated time per format, and its alignment findings by op."""
    rows = []
    for i, L in enumerate(layers):
        cost = L.cost if isinstance(L.cost, R.LayerCost) else None
        n_ops = cost.gemm_ops if cost is not None and isinstance(cost.gemm_ops, int) else None
        found = alignment_findings(L.alignment)
        if not found and not n_ops:
            continue
        ops = []
        for op in found:
            gm = op.get("gemm") or {}
            dims = [d for d in op.get("dims") or [] if isinstance(d, Mapping)]
            bad = sorted({f"{d.get('dim')}={d.get('size')}" for d in dims if d.get("aligned") is False})
            below = sorted({f"{d.get('dim')}={d.get('size')}" for d in dims
                            if d.get("aligned") and d.get("efficient_size") not in (None, d.get("size"))})
            shape = f"{gm.get('m', '?')}×{gm.get('n', '?')}×{gm.get('k', '?')}" + (
                f" ×{gm['batch']}" if gm.get("batch", 1) not in (1, None) else "")
            ops.append({"op": op.get("op"), "shape": shape, "misaligned": bad, "below_tier": below})
        rest = (n_ops - len(found)) if n_ops is not None and n_ops > len(found) else 0
        rows.append({"index": i, "module": L.name or "(model)", "type": L.type, "gemm_ops": n_ops,
                     "flops": cost.flops if cost is not None else None, "times": cost_times(cost, formats),
                     "ops": ops, "rest": rest})
    return rows


# --- the decision in words ----------------------------------------------------------------------------------


def off_default(audit: R.AuditRecord, g: Grouping) -> list[tuple[str, list[str], int]]:
    """Every module the policy runs in another format than the default: the plan's overrides by format, then the
    FP8 plan's modules by recipe (audit.json ``fp8.plan.modules``): (format, the names with their repeats written
    once, how many modules)."""
    by: dict[str, list[str]] = {}
    for name, o in (audit.plan.overrides or {}).items():
        fmt = o.format if isinstance(o, R.ModulePlan) and o.format is not None else "?"
        by.setdefault(str(fmt), []).append(name or "(model)")
    for name, recipe, _ in fp8_moves(audit):
        by.setdefault(recipe, []).append(name)
    return [(f, compress_names(names, g), len(names)) for f, names in by.items()]


def _fp8_planned(audit: R.AuditRecord) -> dict[str, Fp8ModulePlan]:
    """audit.json ``fp8.plan.modules``: the linear layers the FP8 plan converts, with recipe and reason."""
    plan = audit.fp8.plan if isinstance(audit.fp8, Fp8) else None
    mods = plan.modules if isinstance(plan, Fp8PlanReport) else None
    if not isinstance(mods, Mapping):
        return {}
    return {str(n): m for n, m in mods.items() if isinstance(m, Fp8ModulePlan) and m.recipe}


def fp8_moves(audit: R.AuditRecord) -> list[tuple[str, str, str]]:
    """(module, recipe, reason) for each linear layer the FP8 plan converts (docs/fp8.md)."""
    out = []
    for n, m in _fp8_planned(audit).items():
        recipe, reason = str(m.recipe), "" if m.reason is None else str(m.reason)
        out.append((n, recipe, reason.removeprefix(f"{recipe}: ")))
    return out


def _tied(a: float, b: float) -> bool:
    return abs(a - b) <= TIME_TIE * max(abs(b), 1e-30)


def why_chosen(plan: R.PlanReport) -> str | None:
    """Why the returned candidate beat the others within budget, by the planner's rule: the faster estimate, or
    between equal estimates the first of fewer overrides, no loss scaling, the format order that tells them
    apart."""
    cands = [c for c in plan.candidates or [] if isinstance(c, R.PlanCandidateReport)]
    chosen = next((c for c in cands if c.chosen), None)
    if chosen is None or chosen.estimated_step_time_s is None:
        return None
    t0 = chosen.estimated_step_time_s
    rivals = [c for c in cands if not c.chosen and c.within_budget and c.estimated_step_time_s is not None]
    # as fast, but not within budget (or refused for an overflow): the candidate's own note says why
    out_of = [f"{c.label}, as fast, is out: {c.note}" for c in cands
              if not c.chosen and c.within_budget is False and c.estimated_step_time_s is not None
              and _tied(c.estimated_step_time_s, t0) and c.note]
    tied = [c for c in rivals if _tied(c.estimated_step_time_s or 0.0, t0)]
    if not tied:
        slower = [c for c in rivals if (c.estimated_step_time_s or 0.0) > t0]
        if len(slower) != len(rivals) or not (slower or out_of):
            return None  # the rule was not speed (a mixed plan not verified, say): the candidates' notes say why
        text = f"{chosen.label} is the fastest within budget: est. {fmt_seconds(t0)} per step"
        if slower:
            nxt = min(slower, key=lambda c: c.estimated_step_time_s or 0.0)
            text += f", against {fmt_seconds(nxt.estimated_step_time_s)} for {nxt.label}"
        return "; ".join([text, *out_of])
    parts = []
    for c in tied:
        if c.overrides != chosen.overrides:
            why = f"fewer overrides ({chosen.overrides}, {c.overrides})"
        elif c.loss_scaling != chosen.loss_scaling:
            why = "no loss scaling" if not chosen.loss_scaling else "fewer loss-scaled modules"
        else:
            why = f"the format order ({chosen.default_format} before {c.default_format})"
        parts.append(f"{why} against {c.label}")
    text = (f"{chosen.label} ties with {', '.join(c.label for c in tied)} at an estimated {fmt_seconds(t0)} per "
            f"step, all within budget; {TIE_RULE}; so {chosen.label} wins, on " + "; ".join(parts))
    return "; ".join([text, *out_of])


__all__ = ["FORMAT_ORDER", "TIE_RULE", "TIME_TIE", "columns", "fp8_moves", "gemm_modules",
           "layer_rows", "layer_tags", "off_default", "plan_summary", "why_chosen"]
