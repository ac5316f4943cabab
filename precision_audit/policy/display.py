"""How a :class:`~precision_audit.policy.schema.Policy` shows itself: a short ``repr`` (one line, not the
dataclass's every field) and ``_repr_html_`` for a notebook cell (docs/policy.md, "In a notebook").

Data only, like the rest of policy/: plain text and escaped HTML, no script, style or URL.

Example::

    policy = pa.load_policy("audit/policy.json")
    policy            # Policy(TinyGPT on H100 SXM: bf16 by default, no overrides, no loss scaling, TF32 off)
"""

from __future__ import annotations

import math
from html import escape
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .schema import Policy

#: Overrides named in the repr, and rows in the HTML table, before "and N more".
REPR_NAMES = 3
HTML_ROWS = 50


def _fp8_modules(p: Policy) -> dict[str, Any]:
    f8 = p.extra.get("fp8")
    mods = f8.get("modules") if isinstance(f8, dict) else None
    return ({str(k): v for k, v in mods.items() if isinstance(v, dict) and v.get("recipe")}
            if isinstance(mods, dict) else {})


def _scale(p: Policy) -> str:
    ls = p.loss_scaling
    if not ls.enabled:
        return "no loss scaling"
    s = float(ls.init_scale)
    e = math.log2(s) if s > 0 and math.isfinite(s) else None
    return f"loss scale 2^{int(e)}" if e is not None and e.is_integer() else f"loss scale {s:g}"


def policy_repr(p: Policy) -> str:
    by: dict[str, list[str]] = {}
    for name, o in p.modules.items():
        by.setdefault(o.format, []).append(name or "(model)")
    if by:
        parts = [f"{f}: " + ", ".join(ns[:REPR_NAMES]) + (f" and {len(ns) - REPR_NAMES} more" if len(ns) > REPR_NAMES
                                                          else "") for f, ns in by.items()]
        over = f"{len(p.modules)} override{'s' if len(p.modules) != 1 else ''} ({'; '.join(parts)})"
    else:
        over = "no overrides"
    fp8 = _fp8_modules(p)
    tf32 = "TF32 on" if (p.tf32_matmul or p.tf32_cudnn) else "TF32 off"
    return (f"Policy({p.model_class} on {p.target_name}: {p.default_format} by default, {over}, {_scale(p)}, {tf32}"
            + (f", {len(fp8)} module(s) in FP8" if fp8 else "") + ")")


def policy_html(p: Policy) -> str:
    e = escape
    rows = [f"<tr><td><code>{e(n or '(model)')}</code></td><td>{e(o.format)}</td><td>{e(o.reason)}</td></tr>"
            for n, o in list(p.modules.items())[:HTML_ROWS]]
    rows += [f"<tr><td><code>{e(n)}</code></td><td>{e(str(m.get('recipe')))} (FP8)</td>"
             f"<td>{e(str(m.get('reason', '')))}</td></tr>" for n, m in list(_fp8_modules(p).items())[:HTML_ROWS]]
    more = len(p.modules) + len(_fp8_modules(p)) - len(rows)
    table = ("<table><tr><th>module</th><th>format</th><th>reason</th></tr>" + "".join(rows) + "</table>"
             + (f"<div>and {more} more</div>" if more > 0 else "")) if rows else \
        "<div>no overrides: every module runs in the default format</div>"
    return (f"<div><b>precision-audit policy</b> for <code>{e(p.model_class)}</code> on {e(p.target_name)}: "
            f"<b>{e(p.default_format)}</b> by default; {e(_scale(p))}; "
            f"TF32 {'on' if (p.tf32_matmul or p.tf32_cudnn) else 'off'}{table}</div>")
