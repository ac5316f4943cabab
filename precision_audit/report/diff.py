"""Comparing two audits: which layers' plan, error or headroom changed (``precision-audit diff A B``; docs/report.md,
"Comparing two audits").

Both files are read and validated as ``precision-audit report`` reads one (precision_audit/record/codec.py).
Layers are matched by name (their ``named_modules()`` path). For each layer in both:

- ``plan``: the format the plan gave it changed;
- ``error``: per format audited in both, the layer's local relative L2 error changed by more than the noise:
  ``max(rel_tol x the larger of the two, 2 x the FP32 noise floor of that layer in either audit)`` (the noise floor
  is each audit's own ``noise_floor.fp32_layers_rel_l2``: the error FP32 itself shows at a second reduction
  order); or it became non-finite (``null``), or finite again;
- ``headroom``: per format, the activation's headroom (bits between its amax and the format's largest value)
  moved by at least ``headroom_bits``, or changed sign (an overflow appeared or went away).

Layers in only one audit are listed as added / removed.

Example::

    d = diff_audits(load_audit(Path("before/audit.json")), load_audit(Path("after/audit.json")))
    d["changed"][0]["layer"], d["changed"][0]["changes"][0]["field"]   # ("a", "headroom")
"""

from __future__ import annotations

import math
from typing import Any

#: A change in a layer's error smaller than this fraction of the larger one is not reported.
DEFAULT_REL_TOL = 0.25
#: A change in headroom smaller than this many bits is not reported.
DEFAULT_HEADROOM_BITS = 1.0


def _noise(audit: dict[str, Any], name: str) -> float:
    floor = (audit.get("noise_floor") or {}).get("fp32_layers_rel_l2") or {}
    v = floor.get(name)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


def _errors(layer: dict[str, Any]) -> dict[str, float | None]:
    out = {}
    for fmt, e in (layer.get("error") or {}).items():
        if isinstance(e, dict) and isinstance(e.get("local"), dict):
            v = e["local"].get("rel_l2")
            out[fmt] = float(v) if isinstance(v, (int, float)) else None
    return out


def _headroom(layer: dict[str, Any]) -> dict[str, float]:
    h = (layer.get("activation") or {}).get("headroom_bits") or {}
    return {f: float(v) for f, v in h.items() if isinstance(v, (int, float))}


def layer_changes(name: str, a: dict[str, Any], b: dict[str, Any], noise: float, *, rel_tol: float,
                  headroom_bits: float) -> list[dict[str, Any]]:
    """The changes between one layer's entries ``a`` and ``b`` (module docstring)."""
    changes: list[dict[str, Any]] = []
    pa_, pb = (a.get("plan") or {}).get("format"), (b.get("plan") or {}).get("format")
    if pa_ != pb:
        changes.append({"field": "plan", "format": None, "a": pa_, "b": pb})
    ea, eb = _errors(a), _errors(b)
    for fmt in sorted(set(ea) & set(eb)):
        x, y = ea[fmt], eb[fmt]
        if x is None or y is None:
            if (x is None) != (y is None):
                changes.append({"field": "error", "format": fmt, "a": x, "b": y})
            continue
        if abs(x - y) > max(rel_tol * max(abs(x), abs(y)), 2 * noise):
            changes.append({"field": "error", "format": fmt, "a": x, "b": y})
    ha, hb = _headroom(a), _headroom(b)
    for fmt in sorted(set(ha) & set(hb)):
        x, y = ha[fmt], hb[fmt]
        if abs(x - y) >= headroom_bits or (x < 0) != (y < 0):
            changes.append({"field": "headroom", "format": fmt, "a": x, "b": y})
    return changes


def diff_audits(a: dict[str, Any], b: dict[str, Any], *, rel_tol: float = DEFAULT_REL_TOL,
                headroom_bits: float = DEFAULT_HEADROOM_BITS) -> dict[str, Any]:
    """Compare two validated audit.json documents; returns the JSON ``precision-audit diff --json`` prints."""
    la = {layer["name"]: layer for layer in a.get("layers", [])}
    lb = {layer["name"]: layer for layer in b.get("layers", [])}
    changed = []
    for name in la:
        if name not in lb:
            continue
        noise = max(_noise(a, name), _noise(b, name))
        ch = layer_changes(name, la[name], lb[name], noise, rel_tol=rel_tol, headroom_bits=headroom_bits)
        if ch:
            changed.append({"layer": name, "type": lb[name].get("type"), "changes": ch})
    fa, fb = (a.get("model") or {}).get("fingerprint"), (b.get("model") or {}).get("fingerprint")
    return {
        "schema": "precision-audit/diff", "version": 1,
        "same_model": fa == fb,
        "tolerances": {"error_rel": rel_tol, "headroom_bits": headroom_bits,
                       "noise": "2 x the layer's FP32 noise floor (noise_floor.fp32_layers_rel_l2), either audit"},
        "changed": changed,
        "added": [n for n in lb if n not in la],
        "removed": [n for n in la if n not in lb],
        "unchanged": sum(1 for n in la if n in lb) - len(changed),
    }


def _fmt(v: Any, field: str) -> str:
    if v is None:
        return "non-finite" if field == "error" else "-"
    if isinstance(v, float):
        return f"{v:+.1f} bits" if field == "headroom" else f"{v:.3g}"
    return str(v)


def diff_table(d: dict[str, Any], a_label: str, b_label: str) -> str:
    """The diff as a terminal table: one row per change."""
    rows = [("layer", "what", "format", a_label, b_label)]
    for c in d["changed"]:
        for ch in c["changes"]:
            rows.append((c["layer"] or "(root)", ch["field"], ch["format"] or "", _fmt(ch["a"], ch["field"]),
                         _fmt(ch["b"], ch["field"])))
    lines = []
    if not d["same_model"]:
        lines.append("note: the two audits are of different models (fingerprints differ); layers matched by name")
    if len(rows) > 1:
        widths = [min(48, max(len(r[i]) for r in rows)) for i in range(5)]
        for r in rows:
            lines.append("  ".join(cell[:48].ljust(w) for cell, w in zip(r, widths)).rstrip())
    n = len(d["changed"])
    lines.append(f"{n} layer(s) changed, {d['unchanged']} unchanged"
                 + (f", {len(d['added'])} only in B: {', '.join(d['added'][:8])}" if d["added"] else "")
                 + (f", {len(d['removed'])} only in A: {', '.join(d['removed'][:8])}" if d["removed"] else ""))
    return "\n".join(lines)
