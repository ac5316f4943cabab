"""The audit as a Jupyter cell output: ``AuditResult._repr_html_`` (README.md, "In a notebook").

One self-contained HTML fragment built from audit.json's content: the verdict, the per-format table, the plan,
and the per-layer table collapsed in a ``<details>``. No script, no external stylesheet, font or image, and no
URL: a notebook shows it offline, and a sanitising viewer (GitHub, nbviewer) that drops styles still shows
plain tables. Every piece of text from the audit (module names, reasons, warnings) is escaped.

Example::

    html = notebook_html(result.audit, result.policy.to_dict(), result.files)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from .html import fmt_num, fmt_seconds, speedup

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


def notebook_html(audit: Mapping[str, Any], policy: Mapping[str, Any] | None = None,
                  files: Sequence[Path] = ()) -> str:
    """The fragment Jupyter displays for a finished audit (``policy`` and ``files`` are optional)."""
    from .audit_json import as_document

    audit = as_document(audit)
    model = audit.get("model") or {}
    target = (audit.get("target") or {}).get("name", "?")
    verdict = audit.get("verdict") or {}
    ok = verdict.get("exit_code") == 0
    parts = [f'<div class="pa-nb"><style>{_STYLE}</style>',
             f"<div><b>precision-audit</b>: {_e(model.get('class', '?'))} "
             f"({_count(model.get('parameters'))} parameters), target {_e(target)}, {_e(audit.get('mode', '?'))} "
             "mode</div>",
             f'<div class="v {"ok" if ok else "bad"}">{_e(verdict.get("message", ""))} '
             f'<span class="muted">(exit code {_e(verdict.get("exit_code"))})</span></div>',
             _formats_table(audit), _plan(audit, policy), _layers(audit), _warnings(audit), _files(files),
             "</div>"]
    return "\n".join(p for p in parts if p)


def _e(value: Any) -> str:
    return escape("" if value is None else str(value), quote=True)


def _count(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else "?"


def _formats_table(audit: Mapping[str, Any]) -> str:
    summary = audit.get("summary") or {}
    formats = list(audit.get("formats") or [])
    rows = ['<h4>Formats</h4><table><tr><th class="t">format</th><th>loss</th><th>loss change</th>'
            '<th>output error</th><th>non-finite outputs</th><th>est. step</th><th>speedup</th>'
            '<th class="t">verdict</th></tr>']
    for f in ["fp32", *formats]:
        s = summary.get(f) or {}
        out = s.get("output") or {}
        est = (s.get("step_time") or {}).get("estimated_s")
        sp = speedup(audit, f) if f in summary else None
        nonfinite = (s.get("nonfinite") or {}).get("outputs")
        verdict = "reference" if f == "fp32" else s.get("verdict", "")
        cls = ' class="t"' if f == "fp32" else (' class="t ok"' if s.get("safe") else ' class="t bad"')
        rows.append(f'<tr><td class="t">{_e(f)}</td><td>{_e(fmt_num(s.get("loss"), 6))}</td>'
                    f'<td>{"—" if f == "fp32" else _e(fmt_num(s.get("loss_rel_change")))}</td>'
                    f'<td>{"—" if f == "fp32" else _e(fmt_num(out.get("rel_l2")))}</td>'
                    f'<td>{"—" if f == "fp32" else _e(nonfinite)}</td><td>{_e(fmt_seconds(est))}</td>'
                    f'<td>{_e(f"{sp:.2f}x" if sp else "—")}</td><td{cls}>{_e(verdict)}</td></tr>')
    for s in audit.get("formats_skipped") or []:
        rows.append(f'<tr><td class="t">{_e(s.get("format"))}</td><td class="t muted" colspan="7">'
                    f'{_e(s.get("reason"))}</td></tr>')
    rows.append("</table>")
    return "".join(rows)


def _plan(audit: Mapping[str, Any], policy: Mapping[str, Any] | None) -> str:
    plan = audit.get("plan") or {}
    out = [f"<h4>Plan</h4><div>default format <b>{_e(plan.get('default_format'))}</b>: "
           f"{_e(plan.get('default_reason'))}</div>"]
    overrides = plan.get("overrides") or {}
    if overrides:
        out.append('<table><tr><th class="t">module</th><th class="t">format</th><th class="t">reason</th></tr>')
        for name, o in overrides.items():
            out.append(f'<tr><td class="t"><code>{_e(name or "(model)")}</code></td>'
                       f'<td class="t">{_e(o.get("format"))}</td><td class="t">{_e(o.get("reason"))}</td></tr>')
        out.append("</table>")
    else:
        out.append('<div class="muted">no module overrides: every module runs in the default format</div>')
    verification = plan.get("verification")
    if isinstance(verification, Mapping):
        within = verification.get("within_budget")
        out.append(f"<div>verified with one pass under the policy: loss change "
                   f"{_e(fmt_num(verification.get('loss_rel_change')))}, output error "
                   f"{_e(fmt_num(verification.get('output_rel_error')))} "
                   f"({'within' if within else 'outside'} the budget)</div>")
    ls = (policy or {}).get("loss_scaling") or {}
    if ls.get("enabled"):
        out.append(f"<div>fp16 loss scaling: initial scale {_e(fmt_num(ls.get('init_scale')))}</div>")
    return "".join(out)


def _layers(audit: Mapping[str, Any]) -> str:
    layers = [L for L in audit.get("layers") or [] if isinstance(L, Mapping)]
    formats = list(audit.get("formats") or [])
    head = "".join(f"<th>{_e(f)} local error</th>" for f in formats)
    rows = [f"<details><summary>Per-layer table ({len(layers)} modules)</summary><table>"
            f'<tr><th class="t">module</th><th class="t">type</th><th>parameters</th>{head}'
            '<th class="t">plan</th><th class="t">why</th></tr>']
    for L in layers[:MAX_LAYER_ROWS]:
        err = L.get("error") or {}
        cells = "".join(f"<td>{_e(fmt_num(((err.get(f) or {}).get('local') or {}).get('rel_l2')))}</td>"
                        for f in formats)
        plan = L.get("plan") or {}
        rows.append(f'<tr><td class="t"><code>{_e(L.get("name") or "(model)")}</code></td>'
                    f'<td class="t">{_e(L.get("type"))}</td><td>{_e(_count(L.get("own_parameters")))}</td>{cells}'
                    f'<td class="t">{_e(plan.get("format"))}</td><td class="t">{_e(plan.get("reason"))}</td></tr>')
    rows.append("</table>")
    if len(layers) > MAX_LAYER_ROWS:
        rows.append(f'<div class="muted">{len(layers) - MAX_LAYER_ROWS} more modules: see report.html</div>')
    rows.append("</details>")
    return "".join(rows)


def _warnings(audit: Mapping[str, Any]) -> str:
    warnings = [w for w in audit.get("warnings") or [] if w]
    if not warnings:
        return ""
    items = "".join(f"<li>{_e(w)}</li>" for w in warnings)
    return f"<details><summary>Warnings ({len(warnings)})</summary><ul>{items}</ul></details>"


def _files(files: Sequence[Path]) -> str:
    if not files:
        return ('<div class="muted">not saved: call <code>.save("audit")</code> for audit.json, policy.json '
                "and report.html</div>")
    return "<div class=\"muted\">wrote: " + ", ".join(f"<code>{_e(f)}</code>" for f in files) + "</div>"
