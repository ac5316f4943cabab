"""Numbers for people: how the report, the terminal summary and the notebook view write a figure.

The only place figures are formatted (docs/report.md: the report computes nothing, it formats). ``None`` is how
audit.json writes a non-finite value, so it reads as ``inf/NaN`` where a figure was expected.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..formats import SPECS, Format


def fmt_num(x: Any, digits: int = 3) -> str:
    """Numbers for people: ``None`` (a non-finite value in audit.json) reads as ``inf/NaN``."""
    if x is None:
        return "inf/NaN"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if not isinstance(x, float):
        return str(x)
    if not math.isfinite(x):
        return "inf/NaN"
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
    if abs(x) > 1e300:  # x * 100 would overflow to inf: shift the decimal exponent instead
        mantissa, _, exp = f"{x:.1e}".partition("e")
        return f"{mantissa}e+{int(exp) + 2}%"
    if x < 1e-4:
        return f"{x * 100:.1e}%"
    return f"{x * 100:.2f}%"


def fmt_db(x: Any) -> str:
    if x is None:
        return "∞"
    return f"{x:.1f} dB" if abs(x) < 1e5 else f"{x:.2e} dB"  # 1e308 dB (a hand-edited file) in 9 characters


def fmt_seconds(x: Any) -> str:
    if x is None:
        return "—"
    if x >= 1:
        return f"{x:.3g} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms"
    if x >= 1e-6:
        return f"{x * 1e6:.3g} µs"
    return f"{x * 1e9:.3g} ns"


def fmt_bytes(x: Any) -> str:
    if x is None:
        return "—"
    v = float(x)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v):,} B" if unit == "B" else f"{v:.3g} {unit}"
        v /= 1024
    return f"{v:.3g} TiB"  # pragma: no cover


def fmt_scale(x: Any) -> str:
    """A loss scale: ``2^17 (131,072)`` for powers of two, else the number."""
    if x is None:
        return "—"
    if x == 1:
        return "1 (none)"
    if x >= 1 and math.log2(x).is_integer():
        return f"2^{int(math.log2(x))} ({int(x):,})" if x < 1e15 else f"2^{int(math.log2(x))}"
    return fmt_num(x)


def fmt_value(key: str, v: Any) -> str:
    """Format a value of a field this report does not know by name, from its key's unit suffix."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (int, float)):
        k = key.lower()
        if k.endswith("_s") or k.endswith("_seconds"):
            return fmt_seconds(v)
        if "bytes" in k:
            return fmt_bytes(v)
        if k.endswith("_pct") or k.endswith("_percent"):
            return f"{v:.3g}%"
        if "fraction" in k or "share" in k:
            return fmt_pct(v)
        return fmt_num(v)
    if isinstance(v, (list, tuple)):
        if all(not isinstance(i, (dict, list)) for i in v):
            return "×".join(str(i) for i in v) if all(isinstance(i, int) for i in v) and key.endswith("shape") \
                else ", ".join(fmt_value(key, i) for i in v)
        return json.dumps(v)
    if isinstance(v, dict):
        # Children without a unit of their own ("adam" inside "optimizer_bytes") take the parent key's unit.
        return "; ".join(f"{k}: {fmt_value(key, i)}" for k, i in v.items())
    return str(v)


def severity(rel_l2: Any, fmt: str) -> str:
    """A CSS class for an error value, relative to the format's unit roundoff u: ok ≤ 4u < warn ≤ 32u < bad."""
    if rel_l2 is None:
        return "bad"
    try:
        u = SPECS[Format(fmt)].unit_roundoff
    except ValueError:
        u = 2.0**-8
    if rel_l2 <= 4 * u:
        return "ok"
    if rel_l2 <= 32 * u:
        return "warn"
    return "bad"


def _label(key: str) -> str:
    return key.replace("_", " ")
