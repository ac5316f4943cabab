"""The timeline page: audits over a run and the watch's record, as one self-contained HTML file
(``precision-audit report FOLDER``; docs/report.md, "Audits over a run").

Input: a folder of audits (``step-<N>/audit.json``, as the trainer callbacks write with ``audit_every`` / at
checkpoint saves; a sub-folder without a step number is ordered by name after them) and/or a watch log
(``watch.json``, written by ``controller.save_watch`` or by the callbacks; schema ``precision-audit/watch``).

The page, readable at 1280 px without JavaScript (no script, no external resource):

- per format, a heat map of each layer's activation headroom (bits between its amax and the format's largest
  value) over the audits' steps: red where it overflows (below 0), orange under 4 bits, yellow under 8, green
  beyond; each cell's value in its tooltip; layers in the first audit's order;
- from the watch log: the actions taken (step, module, change, the reason with its forecast), the last forecast
  of each module with a crossing, and per module a small chart of log2 of its output amax over the steps, with the
  largest value of each format it ran in as a line.

Example::

    html = render_timeline([(100, audit_a), (200, audit_b)], watch_log)
"""

from __future__ import annotations

import html
import math
from typing import Any

_CELL_W, _CELL_H, _NAME_W = 11, 9, 300


def _esc(v: Any) -> str:
    return html.escape(str(v), quote=True)


def _color(bits: float | None) -> str:
    if bits is None or not math.isfinite(bits):
        return "#bbb"
    if bits < 0:
        return "#d7301f"
    if bits < 4:
        return "#fc8d59"
    if bits < 8:
        return "#fee08b"
    return "#91cf60" if bits < 16 else "#1a9850"


def _heatmaps(audits: list[tuple[int, dict[str, Any]]]) -> str:
    """One SVG: the layer names, then one heat map per format side by side."""
    names: list[str] = []
    for _, a in audits:
        for layer in a.get("layers", []):
            if layer["name"] not in names and (layer.get("activation") or {}).get("headroom_bits"):
                names.append(layer["name"])
    formats: list[str] = []
    for _, a in audits:
        for layer in a.get("layers", []):
            for f in ((layer.get("activation") or {}).get("headroom_bits") or {}):
                if f not in formats:
                    formats.append(f)
    by_step = [(step, {layer["name"]: (layer.get("activation") or {}).get("headroom_bits") or {}
                       for layer in a.get("layers", [])}) for step, a in audits]
    map_w = len(audits) * _CELL_W + 24
    width = _NAME_W + len(formats) * map_w
    height = 30 + len(names) * _CELL_H + 16
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="activation headroom per layer and format over the steps" class="heat">']
    for i, n in enumerate(names):
        y = 30 + i * _CELL_H
        label = n or "(root)"
        short = label if len(label) <= 48 else "…" + label[-47:]
        out.append(f'<text x="{_NAME_W - 6}" y="{y + _CELL_H - 1}" text-anchor="end" class="nm">'
                   f'<title>{_esc(label)}</title>{_esc(short)}</text>')
    for j, fmt in enumerate(formats):
        x0 = _NAME_W + j * map_w
        out.append(f'<text x="{x0}" y="12" class="fm">{_esc(fmt)}</text>')
        out.append(f'<text x="{x0}" y="25" class="ax">steps {_esc(audits[0][0])}…{_esc(audits[-1][0])}</text>')
        for k, (step, heads) in enumerate(by_step):
            x = x0 + k * _CELL_W
            for i, n in enumerate(names):
                v = heads.get(n, {}).get(fmt)
                val = f"{v:+.1f} bits" if isinstance(v, (int, float)) else "not measured"
                out.append(f'<rect x="{x}" y="{30 + i * _CELL_H}" width="{_CELL_W - 1}" height="{_CELL_H - 1}" '
                           f'fill="{_color(v if isinstance(v, (int, float)) else None)}"><title>'
                           f'{_esc(n or "(root)")} at step {step}, {fmt}: {val}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def _format_max(fmt: str) -> float | None:
    from ..formats import SPECS, Format

    try:
        return None if fmt in ("fp32", "tf32") else float(SPECS[Format(fmt)].max)
    except ValueError:
        return None


def _spark(name: str, series: dict[str, Any]) -> str:
    """log2 of the module's output amax over the steps, with each format's largest value it ran in."""
    pts = [(s, math.log2(v)) for s, v in zip(series.get("step", []), series.get("output", []))
           if isinstance(v, (int, float)) and v > 0]
    limits = [(f, math.log2(m)) for f in series.get("formats", []) if (m := _format_max(f)) is not None and m < 1e30]
    if len(pts) < 2:
        return ""
    w, h = 360, 70
    s0, s1 = pts[0][0], pts[-1][0]
    lo = min(v for _, v in pts)
    hi = max([v for _, v in pts] + [lm for _, lm in limits])
    span_s, span_v = max(s1 - s0, 1), max(hi - lo, 1e-9)

    def xy(s: float, v: float) -> str:
        return f"{(s - s0) / span_s * (w - 10) + 5:.1f},{h - 5 - (v - lo) / span_v * (h - 10):.1f}"

    line = " ".join(xy(s, v) for s, v in pts)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" class="sp" role="img" '
             f'aria-label="log2 output amax of {_esc(name)}"><polyline points="{line}" fill="none" stroke="#2b6cb0"/>']
    for fmt, lm in limits:
        y = xy(s0, lm).split(",")[1]
        parts.append(f'<line x1="5" x2="{w - 5}" y1="{y}" y2="{y}" stroke="#d7301f" stroke-dasharray="4 3">'
                     f'<title>{_esc(fmt)} largest value (log2 {lm:.1f})</title></line>')
    parts.append("</svg>")
    return "".join(parts)


def _watch_section(watch: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td>{_esc(a['step'])}</td><td>{_esc(a['module'] or '(root)')}</td><td>{_esc(a['change'])}"
                   f"</td><td>{_esc(a['reason'])}</td></tr>" for a in watch.get("actions", []))
    actions = (f"<table><thead><tr><th>step</th><th>module</th><th>change</th><th>why (the forecast)</th></tr>"
               f"</thead><tbody>{rows}</tbody></table>" if rows else "<p>No action was taken.</p>")
    last: dict[tuple[str, str, str], dict[str, Any]] = {}
    for f in watch.get("forecasts", []):
        last[(f["module"], f["format"], f["kind"])] = f
    frows = "".join(f"<tr><td>{_esc(f['module'] or '(root)')}</td><td>{_esc(f['format'])}</td><td>{_esc(f['kind'])}"
                    f"</td><td>{_esc(f['at'])}</td><td>{_esc(f['step'])}</td><td>{_esc(f['low'])}–{_esc(f['high'])}"
                    f"</td><td>{_esc(f['confidence'])}</td></tr>" for f in last.values())
    forecasts = (f"<table><thead><tr><th>module</th><th>format</th><th>kind</th><th>made at</th><th>crossing</th>"
                 f"<th>95% interval</th><th>confidence</th></tr></thead><tbody>{frows}</tbody></table>"
                 if frows else "<p>No forecast put a crossing within five horizons.</p>")
    modules = watch.get("modules", {})
    acted = {a["module"] for a in watch.get("actions", [])} | {k[0] for k in last}
    shown = [n for n in modules if n in acted] + [n for n in modules if n not in acted]
    sparks = "".join(f'<figure><figcaption>{_esc(n or "(root)")}</figcaption>{_spark(n, modules[n])}</figure>'
                     for n in shown[:60])
    more = f"<p>{len(shown) - 60} more modules in the watch log.</p>" if len(shown) > 60 else ""
    return (f"<h2>Actions</h2>{actions}<h2>Forecasts (the last of each module, format and kind)</h2>{forecasts}"
            f"<h2>Output amax per module (log2; dashed: each format's largest value)</h2>"
            f'<div class="grid">{sparks}</div>{more}')


_CSS = """body{font:14px system-ui,sans-serif;margin:16px;max-width:1260px;color:#111;background:#fff}
h1{font-size:20px}h2{font-size:16px;margin-top:24px}table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
.heat text{font:9px monospace}.heat .fm{font:bold 12px system-ui}.heat .ax{font:10px system-ui;fill:#555}
.scroll{overflow-x:auto}.grid{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0}
figcaption{font:11px monospace;max-width:360px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.key span{display:inline-block;padding:1px 6px;margin-right:4px}
@media (prefers-color-scheme: dark){body{background:#111;color:#eee}.heat text{fill:#ddd}td,th{border-color:#555}}"""


def render_timeline(audits: list[tuple[int, dict[str, Any]]], watch: dict[str, Any] | None,
                    title: str = "precision-audit timeline") -> str:
    """The page for ``audits`` ((step, audit.json) in step order) and ``watch`` (a watch log, or None)."""
    model = next((a.get("model", {}).get("class") for _, a in audits), None) or (watch or {}).get("model") or ""
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8><meta name=viewport "
             f"content='width=device-width'><title>{_esc(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{_esc(title)}{' — ' + _esc(model) if model else ''}</h1>"]
    if audits:
        key = "".join(f'<span style="background:{c}">{t}</span>' for c, t in
                      (("#d7301f", "overflow (&lt;0 bits)"), ("#fc8d59", "&lt;4"), ("#fee08b", "&lt;8"),
                       ("#91cf60", "&lt;16"), ("#1a9850", "≥16 bits"), ("#bbb", "not measured")))
        parts.append(f"<h2>Activation headroom per layer, {len(audits)} audits (steps "
                     f"{', '.join(str(s) for s, _ in audits[:24])}{' …' if len(audits) > 24 else ''})</h2>"
                     f'<p class="key">{key}</p><div class="scroll">{_heatmaps(audits)}</div>')
    if watch is not None:
        parts.append(f"<h2>Watch: every {_esc(watch.get('every'))} steps, {_esc(watch.get('readings'))} readings, "
                     f"horizon {_esc(watch.get('horizon'))}, minimum confidence "
                     f"{_esc(watch.get('min_confidence'))}</h2>{_watch_section(watch)}")
    parts.append("</body></html>")
    return "".join(parts)
