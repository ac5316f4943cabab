"""report.html: one self-contained page rendered by jinja2 (autoescape on) from the finished audit.json.

The report computes nothing: it only formats numbers that audit.json already holds.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from typing import Any

import jinja2

TEMPLATE = "report.html.j2"


def _loader() -> jinja2.BaseLoader:
    root = resources.files("precision_audit.templates")

    def load(name: str) -> str | None:
        f = root.joinpath(name)
        return f.read_text(encoding="utf-8") if f.is_file() else None

    return jinja2.FunctionLoader(load)


def fmt_num(x: Any, digits: int = 3) -> str:
    """Numbers for people: ``None`` (a non-finite value in audit.json) reads as ``inf/NaN``."""
    if x is None:
        return "inf/NaN"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def fmt_pct(x: Any) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0%"
    if x < 1e-4:
        return f"{x * 100:.1e}%"
    return f"{x * 100:.2f}%"


def fmt_db(x: Any) -> str:
    return "∞" if x is None else f"{x:.1f} dB"


def severity(rel_l2: Any, fmt: str) -> str:
    """A CSS class for an error value, relative to the format's unit roundoff."""
    if rel_l2 is None:
        return "bad"
    u = {"fp16": 2.0**-11, "bf16": 2.0**-8}.get(fmt, 2.0**-8)
    if rel_l2 <= 4 * u:
        return "ok"
    if rel_l2 <= 32 * u:
        return "warn"
    return "bad"


def render_html(audit: dict[str, Any], policy: dict[str, Any]) -> str:
    env = jinja2.Environment(loader=_loader(), autoescape=True, undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters.update(num=fmt_num, pct=fmt_pct, db=fmt_db)
    env.globals.update(severity=severity, isfinite=lambda x: x is not None and math.isfinite(x))
    policy_json = json.dumps(policy, indent=2)
    return env.get_template(TEMPLATE).render(a=audit, policy=policy, policy_json=policy_json)
