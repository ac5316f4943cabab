"""Reading the audit's typed record for the report (precision_audit/record/__init__.py, docs/record.md): the optional
sections and the notes that stand in for them, the per-format summaries, the per-layer costs and alignment
records, the verification's curves and the estimated speedups. Shared by the view model (report/view.py) and the
verdict box (report/headline.py).

Example::

    speedup(record, "bf16"), cost_times(record.layers[0].cost), given(record.memory)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

from .. import record as R

#: The names an older ``verify`` section used for its loss curves (shown apart from the rest of the section).
CURVE_KEYS = ("curves", "loss_curves", "losses", "runs")


# --- reading the record ------------------------------------------------------------------------------------


def given(section: Any) -> bool:
    """Whether an optional section holds anything: not None, and not an empty object in the file (a read
    record whose every field was absent).

    That is whether ``to_json(section)`` has a key, read from the section's own fields without writing its
    content out (the page asks it of every layer's cost, docs/report.md): a key is written for every field but
    an internal one or a None that the file left out or that is ``omit_none``, and for every ``extra`` key."""
    if isinstance(section, R.Summary):
        return True  # audit.json's summary always holds its "fp32" key
    if isinstance(section, R.Section):
        if section.extra:
            return True
        absent = section.absent
        return any(getattr(section, name) is not None or not (key in absent or omit_none)
                   for name, key, omit_none in _written_fields(cast(type, type(section))))
    return bool(section)


@functools.cache
def _written_fields(cls: type) -> tuple[tuple[str, str, bool], ...]:
    """(attribute, audit.json key, omit_none) of each field of ``cls`` that to_json writes (not internal)."""
    return tuple((f.name, f.metadata.get("key", f.name), bool(f.metadata.get("omit_none")))
                 for f in dataclasses.fields(cls) if not f.metadata.get("internal"))


def is_gap(note: Any) -> bool:
    """Whether a ``*_note`` says something was not measured (rather than, say, "no computation of its own")."""
    return isinstance(note, str) and note.lower().startswith(("not measured", "not estimated", "not available"))


def summary_of(audit: R.AuditRecord, f: str) -> R.ReferenceSummary | R.FormatSummary | None:
    """``summary.<f>``: the FP32 reference for ``"fp32"``, else that format's pass (None when it has none)."""
    return audit.summary.fp32 if f == "fp32" else audit.summary.formats.get(f)


def step_time(audit: R.AuditRecord, f: str) -> R.StepTime | None:
    s = summary_of(audit, f)
    return s.step_time if s is not None and isinstance(s.step_time, R.StepTime) else None


def note_of(audit: R.AuditRecord, key: str, default: str) -> str:
    """A top-level ``<key>_note`` of the file (an older or hand-edited audit.json), else ``default``."""
    n = audit.extra.get(f"{key}_note")
    return n if isinstance(n, str) and n else default


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def cost_times(cost: R.LayerCost | None, formats: Sequence[str] | None = None,
               kind: str = "estimated") -> dict[str, float]:
    """Per-format times (seconds) from a layer's cost: ``estimated_step_time_s`` (the target estimate) or, with
    ``kind="measured"``, ``measured_forward_time_s`` (an older file's ``estimated_s`` / ``measured_s`` too).
    ``formats`` None: all."""
    if not isinstance(cost, R.LayerCost):
        return {}
    field, old = (("estimated_step_time_s", "estimated_s") if kind == "estimated"
                  else ("measured_forward_time_s", "measured_s"))
    flat = getattr(cost, field)
    if flat is None:
        flat = cost.extra.get(old)
    if not isinstance(flat, Mapping):
        return {}
    return {str(f): float(t) for f, t in flat.items() if (formats is None or f in formats) and is_number(t)}


def alignment_findings(alignment: Any) -> list[dict[str, Any]]:
    """A layer's alignment records (one per GEMM/conv/attention op that ran): a list, or ``{"findings": [...]}``."""
    if isinstance(alignment, Mapping):
        alignment = next((alignment[k] for k in ("findings", "ops") if alignment.get(k) is not None), None)
    if isinstance(alignment, (list, tuple)):
        return [dict(a) for a in alignment if isinstance(a, Mapping)]
    return []


def misaligned_rows(layers: Sequence[R.LayerReport]) -> list[dict[str, Any]]:
    """One row per misaligned dimension of an op that ran (the same dim for several formats is one row)."""
    rows = []
    for i, L in enumerate(layers):
        for op in alignment_findings(L.alignment):
            groups: dict[tuple, list[Mapping[str, Any]]] = {}
            for d in op.get("dims") or []:
                if isinstance(d, Mapping) and d.get("aligned") is False:
                    key = (d.get("dim"), d.get("size"), d.get("required_multiple"), d.get("suggested_size"))
                    groups.setdefault(key, []).append(d)
            for (dim, size, multiple, suggested), ds in groups.items():
                fmts = [str(d.get("format")) for d in ds]
                saving = op.get("estimated_saving_s") or {}
                rows.append({
                    "index": i, "module": L.name or "(model)", "op": op.get("op"), "kind": op.get("kind"),
                    "gemm": op.get("gemm") or {}, "calls": op.get("calls"), "dim": dim, "dim_name": ds[0].get("name"),
                    "size": size, "formats": fmts, "multiple": multiple, "suggested": suggested,
                    "efficient_multiple": ds[0].get("efficient_multiple"),
                    "efficient_size": ds[0].get("efficient_size"),
                    "tile_waste_pct": ds[0].get("tile_waste_pct"), "cost": ds[0].get("cost"),
                    "saving": {f: saving.get(f) for f in fmts
                               if isinstance(saving, Mapping) and saving.get(f) is not None},
                    "measured": op.get("measured"), "note": op.get("note")})
    return rows


def loss_curve_series(verify: R.VerifyResult | None) -> dict[str, list[float | None]]:
    """The verification's loss curves, run name -> loss per step (``curves``; an older file's
    ``loss_curves``/``losses``/``runs``, kept in the record's ``extra``)."""
    if not isinstance(verify, R.VerifyResult):
        return {}
    src: Any = verify.curves if verify.curves is not None else next(
        (verify.extra[k] for k in CURVE_KEYS[1:] if verify.extra.get(k) is not None), None)
    out: dict[str, list[float | None]] = {}
    if isinstance(src, Mapping):
        for name, v in src.items():
            if isinstance(v, Mapping):
                v = next((v[k] for k in ("losses", "loss", "curve") if v.get(k) is not None), None)
            if isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (int, float)) for x in v):
                out[str(name)] = [None if x is None else float(x) for x in v]
    return out


def speedup(audit: R.AuditRecord, f: str) -> float | None:
    """Estimated speedup of the all-``f`` step over FP32 on the target (the record's ``estimated_speedup``:
    ``estimates.speedup_vs_fp32``, or the ratio of the two ``summary.<f>.step_time.estimated_s``)."""
    return audit.estimated_speedup(f)


def relative_to_fp32(change: Any, audit: R.AuditRecord) -> float | None:
    """An absolute loss change (the loss's own units) as a change relative to the FP32 loss, the basis of every
    other loss change the report shows; None when the FP32 loss is 0, absent or the quotient overflows."""
    ref = audit.summary.fp32.loss
    if not is_number(change) or not is_number(ref) or not ref:
        return None
    rel = abs(change) / abs(ref)
    return rel if math.isfinite(rel) else None


def output_gradient(L: R.LayerReport) -> R.OutputGradient | None:
    g = L.gradient
    out = g.output if isinstance(g, R.Gradient) else None
    return out if isinstance(out, R.OutputGradient) else None
