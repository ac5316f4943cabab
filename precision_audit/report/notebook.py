"""The audit as a Jupyter cell output: ``AuditResult._repr_html_`` (README.md, "In a notebook").

One self-contained HTML fragment built from the audit's record (precision_audit/record/__init__.py): the verdict, the
per-format table, the plan, and the per-layer table collapsed in a ``<details>``. No script, no external
stylesheet, font or image, and no URL: a notebook shows it offline, and a sanitising viewer (GitHub, nbviewer) that
drops styles still shows plain tables. Every piece of text from the audit (module names, reasons, warnings) is
escaped.

Example::

    html = notebook_html(result.record, result.policy.to_dict(), result.files)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from ..record import AuditRecord, LayerReport, PlanReport
from .numbers import fmt_num, fmt_seconds

#: Per-layer rows shown before the table says how many more are in report.html.
MAX_LAYER_ROWS = 500

# Scoped under .pa-nb so that it styles nothing else in the notebook.
_STYLE = """
.pa-nb{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px;line-height:1.4}
.pa-nb table{border-collapse:collapse;margin:4px 0 10px}
.pa-nb th,.pa-nb td{border:1px solid #ccc;padding:2px 8px;text-align:right;vertical-align:top}
.pa-nb th{background:#f3f3f3}
.pa-nb td.t,.pa-nb th.t{text-align:left}
.pa-nb .v{padding:6px 10px;border-radius:4px;margin:4px 0 8px;font-weight:600}
.pa-nb .ok{background:#e3f4e3;color:#14501a}
.pa-nb .bad{background:#fbe4e4;color:#7a1212}
.pa-nb .muted{color:#666}
.pa-nb details{margin:4px 0}
.pa-nb summary{cursor:pointer;font-weight:600}
.pa-nb h4{margin:10px 0 2px}
"""


def notebook_html(audit: AuditRecord | Mapping[str, Any], policy: Mapping[str, Any] | None = None,
                  files: Sequence[Path] = ()) -> str:
    """The fragment Jupyter displays for a finished audit (``policy`` and ``files`` are optional); ``audit`` is
    the audit's record, or audit.json's content (read into the record first)."""
    from ..record.codec import as_record

    r = as_record(audit)
    ok = r.verdict.exit_code == 0
    parts = [f'<div class="pa-nb"><style>{_STYLE}</style>',
             f"<div><b>precision-audit</b>: {_e(r.model.class_)} "
             f"({_count(r.model.parameters)} parameters), target {_e(r.target.get('name', '?'))}, {_e(r.mode)} "
             "mode</div>",
             f'<div class="v {"ok" if ok else "bad"}">{_e(r.verdict.message)} '
             f'<span class="muted">(exit code {_e(r.verdict.exit_code)})</span></div>',
             _formats_table(r), _plan(r.plan, policy), _layers(r), _warnings(r.warnings), _files(files),
             "</div>"]
    return "\n".join(p for p in parts if p)


def _e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def _count(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def _formats_table(r: AuditRecord) -> str:
    rows = ['<h4>Formats</h4><table><tr><th class="t">format</th><th>loss</th><th>loss change</th>'
            '<th>output error</th><th>non-finite outputs</th><th>est. step</th><th>speedup</th>'
            '<th class="t">verdict</th></tr>']
    ref = r.summary.fp32
    rows.append(f'<tr><td class="t">fp32</td><td>{_e(fmt_num(ref.loss, 6))}</td><td>—</td><td>—</td><td>—</td>'
                f'<td>{_e(fmt_seconds(ref.step_time.estimated_s))}</td><td>{_e(_speedup(r, "fp32"))}</td>'
                '<td class="t">reference</td></tr>')
    for f in r.formats:
        s = r.summary.formats.get(f)
        if s is None:
            rows.append(f'<tr><td class="t">{_e(f)}</td><td>{_e(fmt_num(None, 6))}</td><td>—</td><td>—</td>'
                        '<td>—</td><td>—</td><td>—</td><td class="t bad"></td></tr>')
            continue
        out = s.output.rel_l2 if s.output else None
        cls = ' class="t ok"' if s.safe else ' class="t bad"'
        rows.append(f'<tr><td class="t">{_e(f)}</td><td>{_e(fmt_num(s.loss, 6))}</td>'
                    f'<td>{_e(fmt_num(s.loss_rel_change))}</td><td>{_e(fmt_num(out))}</td>'
                    f'<td>{_e(s.nonfinite.outputs)}</td><td>{_e(fmt_seconds(s.step_time.estimated_s))}</td>'
                    f'<td>{_e(_speedup(r, f))}</td><td{cls}>{_e(s.verdict)}</td></tr>')
    for skipped in r.formats_skipped:
        rows.append(f'<tr><td class="t">{_e(skipped.format)}</td><td class="t muted" colspan="7">'
                    f'{_e(skipped.reason)}</td></tr>')
    rows.append("</table>")
    return "".join(rows)


def _speedup(r: AuditRecord, f: str) -> str:
    sp = r.estimated_speedup(f)
    return f"{sp:.2f}x" if sp else "—"


def _plan(plan: PlanReport, policy: Mapping[str, Any] | None) -> str:
    out = [f"<h4>Plan</h4><div>default format <b>{_e(plan.default_format)}</b>: "
           f"{_e(plan.default_reason)}</div>"]
    if plan.overrides:
        out.append('<table><tr><th class="t">module</th><th class="t">format</th><th class="t">reason</th></tr>')
        for name, o in plan.overrides.items():
            out.append(f'<tr><td class="t"><code>{_e(name or "(model)")}</code></td>'
                       f'<td class="t">{_e(o.format)}</td><td class="t">{_e(o.reason)}</td></tr>')
        out.append("</table>")
    else:
        out.append('<div class="muted">no module overrides: every module runs in the default format</div>')
    v = plan.verification
    if v is not None:
        out.append(f"<div>verified with one pass under the policy: loss change "
                   f"{_e(fmt_num(v.loss_rel_change))}, output error {_e(fmt_num(v.output_rel_error))} "
                   f"({'within' if v.within_budget else 'outside'} the budget)</div>")
    ls = (policy or {}).get("loss_scaling") or {}
    if ls.get("enabled"):
        out.append(f"<div>fp16 loss scaling: initial scale {_e(fmt_num(ls.get('init_scale')))}</div>")
    return "".join(out)


def _layers(r: AuditRecord) -> str:
    head = "".join(f"<th>{_e(f)} local error</th>" for f in r.formats)
    rows = [f"<details><summary>Per-layer table ({len(r.layers)} modules)</summary><table>"
            f'<tr><th class="t">module</th><th class="t">type</th><th>parameters</th>{head}'
            '<th class="t">plan</th><th class="t">why</th></tr>']
    for L in r.layers[:MAX_LAYER_ROWS]:
        cells = "".join(f"<td>{_e(fmt_num(_local_rel_l2(L, f)))}</td>" for f in r.formats)
        rows.append(f'<tr><td class="t"><code>{_e(L.name or "(model)")}</code></td>'
                    f'<td class="t">{_e(L.type)}</td><td>{_e(_count(L.own_parameters))}</td>{cells}'
                    f'<td class="t">{_e(L.plan.format)}</td><td class="t">{_e(L.plan.reason)}</td></tr>')
    rows.append("</table>")
    if len(r.layers) > MAX_LAYER_ROWS:
        rows.append(f'<div class="muted">{len(r.layers) - MAX_LAYER_ROWS} more modules: see report.html</div>')
    rows.append("</details>")
    return "".join(rows)


def _local_rel_l2(L: LayerReport, f: str) -> float | None:
    e = L.error.get(f)
    return e.local.rel_l2 if e is not None and e.local is not None else None


def _warnings(warnings: list[str]) -> str:
    shown = [w for w in warnings if w]
    if not shown:
        return ""
    items = "".join(f"<li>{_e(w)}</li>" for w in shown)
    return f"<details><summary>Warnings ({len(shown)})</summary><ul>{items}</ul></details>"


def _files(files: Sequence[Path]) -> str:
    if not files:
        return ('<div class="muted">not saved: call <code>.save("audit")</code> for audit.json, policy.json '
                "and report.html</div>")
    return "<div class=\"muted\">wrote: " + ", ".join(f"<code>{_e(f)}</code>" for f in files) + "</div>"
