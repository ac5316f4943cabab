"""Charts for report.html, drawn as inline SVG by our own code from numbers already in audit.json.

Each function takes plain numbers (picked out of audit.json by :mod:`precision_audit.report.html`) and
returns one ``<svg>`` element as :class:`markupsafe.Markup`. Every piece of text that came from the
user's model (module names) goes through :func:`markupsafe.escape`. Colours are CSS classes
(``s-fp16``, ``act``, ``grad``, ...) that the page styles, so the charts follow light/dark mode and print.
Coordinates are rounded to 0.1 px: the output is deterministic and stays small for 500-layer models.

Example::

    svg = error_by_layer(["fc1", "fc2"], {"fp16": ErrorSeries(local=[1e-4, 2e-4], accumulated=[1e-4, 3e-4])})
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from markupsafe import Markup, escape

W, H = 960.0, 320.0  # viewBox size; the page scales the SVG to its width
LEFT, RIGHT, TOP, BOTTOM = 64.0, 170.0, 16.0, 44.0  # plot margins (legend on the right)


def _f(x: float) -> str:
    """A coordinate with one decimal, without a trailing '.0'."""
    s = f"{x:.1f}"
    return s[:-2] if s.endswith(".0") else s


def _pow2_label(e: float) -> str:
    return f"2^{int(e)}" if float(e).is_integer() else f"2^{e:.1f}"


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
        return f"{x:.2e}"
    return f"{x:.3g}"


def series_class(name: str) -> str:
    """The CSS class of a series: one per format name; anything else falls back to a neutral class."""
    safe = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return f"s-{safe}"


@dataclass
class _Frame:
    """Maps data coordinates to the plot area of one chart."""

    x0: float
    x1: float
    y0: float
    y1: float
    width: float = W
    height: float = H

    def __post_init__(self) -> None:
        if self.x1 <= self.x0:
            self.x1 = self.x0 + 1
        if self.y1 <= self.y0:
            self.y1 = self.y0 + 1

    @property
    def px0(self) -> float:
        return LEFT

    @property
    def px1(self) -> float:
        return self.width - RIGHT

    @property
    def py0(self) -> float:
        return self.height - BOTTOM

    @property
    def py1(self) -> float:
        return TOP

    def x(self, v: float) -> float:
        return self.px0 + (v - self.x0) / (self.x1 - self.x0) * (self.px1 - self.px0)

    def y(self, v: float) -> float:
        v = min(max(v, self.y0), self.y1)
        return self.py0 - (v - self.y0) / (self.y1 - self.y0) * (self.py0 - self.py1)


def _open(chart_id: str, title: str, desc: str, height: float = H) -> list[str]:
    return [f'<svg class="chart" id="{escape(chart_id)}" viewBox="0 0 {_f(W)} {_f(height)}" role="img" '
            f'aria-labelledby="{escape(chart_id)}-t {escape(chart_id)}-d" xmlns="http://www.w3.org/2000/svg">',
            f'<title id="{escape(chart_id)}-t">{escape(title)}</title>',
            f'<desc id="{escape(chart_id)}-d">{escape(desc)}</desc>']


def _axes(fr: _Frame, y_ticks: Sequence[tuple[float, str]], x_ticks: Sequence[tuple[float, str]],
          x_label: str, y_label: str) -> list[str]:
    out = ['<g class="axis">']
    for v, label in y_ticks:
        y = _f(fr.y(v))
        out.append(f'<line class="grid" x1="{_f(fr.px0)}" x2="{_f(fr.px1)}" y1="{y}" y2="{y}"/>')
        out.append(f'<text x="{_f(fr.px0 - 6)}" y="{y}" text-anchor="end" dominant-baseline="middle">'
                   f'{escape(label)}</text>')
    for v, label in x_ticks:
        x = _f(fr.x(v))
        out.append(f'<line class="tick" x1="{x}" x2="{x}" y1="{_f(fr.py0)}" y2="{_f(fr.py0 + 4)}"/>')
        out.append(f'<text x="{x}" y="{_f(fr.py0 + 16)}" text-anchor="middle">{escape(label)}</text>')
    out.append(f'<line class="frame" x1="{_f(fr.px0)}" x2="{_f(fr.px1)}" y1="{_f(fr.py0)}" y2="{_f(fr.py0)}"/>')
    out.append(f'<line class="frame" x1="{_f(fr.px0)}" x2="{_f(fr.px0)}" y1="{_f(fr.py0)}" y2="{_f(fr.py1)}"/>')
    out.append(f'<text class="label" x="{_f((fr.px0 + fr.px1) / 2)}" y="{_f(fr.height - 6)}" '
               f'text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text class="label" transform="translate(14 {_f((fr.py0 + fr.py1) / 2)}) rotate(-90)" '
               f'text-anchor="middle">{escape(y_label)}</text>')
    out.append("</g>")
    return out


def _legend(fr: _Frame, items: Sequence[tuple[str, str]], y_start: float | None = None) -> list[str]:
    """items: (css class list, label). Each gets a short line sample."""
    out = ['<g class="legend">']
    y = TOP + 8 if y_start is None else y_start
    x = fr.px1 + 16
    for cls, label in items:
        if cls.split()[0] == "dots":
            out.append(f'<path class="{escape(cls)}" d="M{_f(x + 5)} {_f(y)}h0M{_f(x + 17)} {_f(y)}h0"/>')
        else:
            out.append(f'<line class="{escape(cls)}" x1="{_f(x)}" x2="{_f(x + 22)}" y1="{_f(y)}" y2="{_f(y)}"/>')
        out.append(f'<text x="{_f(x + 28)}" y="{_f(y)}" dominant-baseline="middle">{escape(label)}</text>')
        y += 18
    out.append("</g>")
    return out


def _x_ticks_for_layers(n: int) -> list[tuple[float, str]]:
    if n <= 1:
        return [(0, "0")]
    step = max(1, _nice_step((n - 1) / 10))
    return [(float(i), str(i)) for i in range(0, n, step)]


def _nice_step(raw: float) -> int:
    if raw <= 1:
        return 1
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * mag:
            return int(m * mag)
    return int(10 * mag)


Units = Sequence[tuple[int, int, str]]
UNIT_AXIS_LABEL = "modules, by branch of the module tree"


def _common_prefix(labels: Sequence[str]) -> str:
    """The dotted prefix every label shares (``transformer.``), dropped from the axis labels."""
    parts = [lb.split(".")[:-1] for lb in labels]
    if not parts:
        return ""
    out: list[str] = []
    for tup in zip(*parts):
        if len(set(tup)) != 1:
            break
        out.append(tup[0])
    return ".".join(out) + "." if out else ""


def _tree_axis(fr: _Frame, units: Units) -> list[str]:
    """The x axis over the module tree: a tick where each unit (a top-level module, or one repeat of a block)
    starts, its name under it where there is room, and every other unit shaded. A unit spans its modules'
    slots, half a slot either side of its first and last."""
    if not units:
        return []
    cut = len(_common_prefix([u[2] for u in units]))
    out = ['<g class="tree-axis">']
    last_right = -1e9
    for k, (a, b, label) in enumerate(units):
        x0, x1 = max(fr.x(a - 0.5), fr.px0), min(fr.x(b + 0.5), fr.px1)
        if k % 2:
            out.append(f'<rect class="unit-band" x="{_f(x0)}" y="{_f(fr.py1)}" width="{_f(max(x1 - x0, 1))}" '
                       f'height="{_f(fr.py0 - fr.py1)}"/>')
        out.append(f'<line class="tick" x1="{_f(x0)}" x2="{_f(x0)}" y1="{_f(fr.py0)}" y2="{_f(fr.py0 + 4)}"/>')
        text = label[cut:] or label
        width = 6.2 * len(text)
        mid = (x0 + x1) / 2
        if mid - width / 2 > last_right + 6 and mid + width / 2 <= fr.width:
            out.append(f'<text x="{_f(mid)}" y="{_f(fr.py0 + 16)}" text-anchor="middle"><title>{escape(label)}'
                       f'</title>{escape(text)}</text>')
            last_right = mid + width / 2
    out.append("</g>")
    return out


def _hover_columns(fr: _Frame, tips: Sequence[str], centred: bool = False) -> list[str]:
    """One transparent column per layer carrying a tooltip (<title>) with that layer's figures.

    ``centred``: layer i occupies the slot [i - 0.5, i + 0.5] (bar charts); else the columns split the
    distance between neighbouring points (line charts over 0 .. n-1).
    """
    n = len(tips)
    if n == 0:
        return []
    if centred:
        half = (fr.x(1) - fr.x(0)) / 2
    else:
        half = (fr.px1 - fr.px0) / max(n - 1, 1) / 2 if n > 1 else (fr.px1 - fr.px0) / 2
    out = ['<g class="hover">']
    for i, tip in enumerate(tips):
        x = fr.x(i) - half
        out.append(f'<rect x="{_f(x)}" y="{_f(fr.py1)}" width="{_f(2 * half)}" height="{_f(fr.py0 - fr.py1)}">'
                   f'<title>{escape(tip)}</title></rect>')
    out.append("</g>")
    return out


# --- error by layer -------------------------------------------------------------------------------------


@dataclass
class ErrorSeries:
    """Relative L2 errors of one format, one entry per layer in order; None = non-finite, 0 = exact."""

    local: list[float | None] = field(default_factory=list)
    accumulated: list[float | None] = field(default_factory=list)
    local_missing: list[bool] = field(default_factory=list)  # True where local error was not measured


def error_by_layer(names: Sequence[str], series: dict[str, ErrorSeries], chart_id: str = "chart-error-svg",
                   units: Units = ()) -> Markup:
    """Local (dashed) and accumulated (solid) relative L2 error per layer, log scale.

    An exact match (0) is drawn on an "exact" row below the axis, a non-finite error on a row above it.
    """
    vals = [v for s in series.values() for v in (*s.local, *s.accumulated) if v is not None and v > 0]
    lo = math.floor(math.log10(min(vals))) if vals else -8
    hi = math.ceil(math.log10(max(vals))) if vals else 0
    lo, hi = min(lo, hi - 2), max(hi, lo + 2)
    exact_row, nonfinite_row = lo - 0.7, hi + 0.7
    n = len(names)
    fr = _Frame(0, max(n - 1, 1), exact_row - 0.3, nonfinite_row + 0.3)

    def y_of(v: float | None) -> float:
        if v is None:
            return nonfinite_row
        if v <= 0:
            return exact_row
        return math.log10(v)

    ticks = [(float(d), f"1e{d}") for d in range(lo, hi + 1)] + [(exact_row, "exact"), (nonfinite_row, "inf/NaN")]
    out = _open(chart_id, "Relative error by layer",
                "Relative L2 error of each layer's output against FP32, per format, in execution order; "
                "dashed: local (the layer alone on FP32 inputs), solid: accumulated (in the all-low-precision run). "
                "Log scale.")
    if units:
        out += _tree_axis(fr, units)
    out += _axes(fr, ticks, [] if units else _x_ticks_for_layers(n),
                 UNIT_AXIS_LABEL if units else "layer (in the order its forward started)", "relative L2 error (log)")
    legend = []
    for fmt, s in series.items():
        cls = series_class(fmt)
        pts = [f"{_f(fr.x(i))},{_f(fr.y(y_of(v)))}" for i, v in enumerate(s.accumulated)]
        if pts:
            out.append(f'<polyline class="series {cls}" points="{" ".join(pts)}"/>')
        # Local errors are dots: one path of zero-length segments with round caps (one element, not one per layer).
        dots = [f"M{_f(fr.x(i))} {_f(fr.y(y_of(v)))}h0" for i, v in enumerate(s.local)
                if not (i < len(s.local_missing) and s.local_missing[i])]
        if dots:
            out.append(f'<path class="dots {cls}" d="{"".join(dots)}"/>')
        legend.append((f"series {cls}", f"{fmt} accumulated"))
        legend.append((f"dots {cls}", f"{fmt} local"))
    out += _legend(fr, legend)
    tips = []
    for i, name in enumerate(names):
        parts = [f"#{i} {name or '(model)'}"]
        for fmt, s in series.items():
            loc = "not measured" if (i < len(s.local_missing) and s.local_missing[i]) else _err(s.local[i])
            parts.append(f"{fmt}: local {loc}, accumulated {_err(s.accumulated[i])}")
        tips.append("\n".join(parts))
    out += _hover_columns(fr, tips)
    out.append("</svg>")
    return Markup("\n".join(out))


def _err(v: float | None) -> str:
    if v is None:
        return "inf/NaN"
    if v == 0:
        return "0 (exact)"
    return _num(v)


# --- ranges against format bands -------------------------------------------------------------------------


@dataclass(frozen=True)
class Band:
    """A format's representable magnitudes, as log2 values: subnormals from ``sub``, normals from ``normal``
    up to ``max``."""

    name: str
    sub: float
    normal: float
    max: float


@dataclass(frozen=True)
class LayerRange:
    """log2 of the smallest and largest non-zero magnitudes of one layer's activations and output gradients."""

    name: str
    act: tuple[float, float] | None
    grad: tuple[float, float] | None
    act_tip: str = ""
    grad_tip: str = ""


def ranges(layers: Sequence[LayerRange], bands: Sequence[Band], chart_id: str = "chart-ranges-svg",
           units: Units = ()) -> Markup:
    """Per layer, the span of activation and gradient magnitudes (log2) against the formats' bands.

    The FP16 band is shaded across the plot; every band is drawn as a ruler on the right (lighter part:
    subnormals); bands that reach beyond the plot say so.
    """
    spans = [v for L in layers for r in (L.act, L.grad) if r for v in r]
    lo = math.floor(min(spans)) - 2 if spans else -30
    hi = math.ceil(max(spans)) + 2 if spans else 20
    fp16 = next((b for b in bands if b.name == "fp16"), None)
    if fp16:
        lo, hi = min(lo, math.floor(fp16.sub) - 2), max(hi, math.ceil(fp16.max) + 2)
    lo, hi = max(lo, -160), min(hi, 140)
    n = len(layers)
    fr = _Frame(-0.5, max(n - 0.5, 0.5), lo, hi)
    out = _open(chart_id, "Activation and gradient magnitudes against format ranges",
                "For each layer, a vertical bar from the smallest to the largest non-zero magnitude of its output "
                "(activations) and of the gradient of the loss with respect to its output, on a log2 scale, in the "
                "FP32 reference run; shaded: FP16's normal range (lighter: its subnormals); rulers on the right: "
                "each format's range.")
    step = max(2, _nice_step((hi - lo) / 10))
    ticks = [(float(e), _pow2_label(e)) for e in range(math.ceil(lo / step) * step, hi + 1, step)]
    if fp16:
        out.append('<g class="band">')
        out.append(f'<rect class="band-sub" x="{_f(fr.px0)}" y="{_f(fr.y(fp16.normal))}" width="{_f(fr.px1 - fr.px0)}" '
                   f'height="{_f(fr.y(fp16.sub) - fr.y(fp16.normal))}"><title>FP16 subnormals: '
                   f'{_pow2_label(fp16.sub)} to {_pow2_label(fp16.normal)} (reduced precision)</title></rect>')
        out.append(f'<rect class="band-normal" x="{_f(fr.px0)}" y="{_f(fr.y(fp16.max))}" width="{_f(fr.px1 - fr.px0)}" '
                   f'height="{_f(fr.y(fp16.normal) - fr.y(fp16.max))}"><title>FP16 normal range: '
                   f'{_pow2_label(fp16.normal)} to {2 ** fp16.max:.0f}</title></rect>')
        out.append("</g>")
    if units:
        out += _tree_axis(fr, units)
    out += _axes(fr, ticks, [] if units else _x_ticks_for_layers(n),
                 UNIT_AXIS_LABEL if units else "layer (in the order its forward started)", "magnitude (log2)")
    # Rulers: one column per format on the right.
    out.append('<g class="rulers">')
    for k, b in enumerate(bands):
        x = fr.px1 + 24 + k * 34
        y_sub_top, y_sub_bot = fr.y(b.normal), fr.y(b.sub)
        y_norm_top, y_norm_bot = fr.y(b.max), fr.y(b.normal)
        out.append(f'<rect class="ruler-sub" x="{_f(x)}" y="{_f(y_sub_top)}" width="10" '
                   f'height="{_f(max(y_sub_bot - y_sub_top, 0))}"/>')
        beyond = []
        if b.max > hi:
            beyond.append(f"max {_pow2_label(round(b.max, 1))} above")
        if b.sub < lo:
            beyond.append(f"subnormals from {_pow2_label(round(b.sub, 1))} below")
        out.append(f'<rect class="ruler" x="{_f(x)}" y="{_f(y_norm_top)}" width="10" '
                   f'height="{_f(max(y_norm_bot - y_norm_top, 0))}"><title>{escape(b.name)}: subnormals from '
                   f'{_pow2_label(round(b.sub, 2))}, normals from {_pow2_label(round(b.normal, 2))}, max '
                   f'{_pow2_label(round(b.max, 2))}{"; " + "; ".join(beyond) + " this chart" if beyond else ""}'
                   f'</title></rect>')
        out.append(f'<text class="ruler-label" x="{_f(x + 5)}" y="{_f(fr.py0 + 16)}" text-anchor="middle">'
                   f'{escape(b.name.replace("fp8_", ""))}</text>')
    out.append("</g>")
    width = max(min((fr.px1 - fr.px0) / max(n, 1) * 0.35, 6.0), 1.0)
    for attr, cls, dx in (("act", "act", -0.18), ("grad", "grad", 0.18)):
        segs = []
        for i, L in enumerate(layers):
            r = getattr(L, attr)
            if r:
                y_top, y_bot = fr.y(r[1]), fr.y(r[0])
                y_bot = max(y_bot, y_top + 1.0)
                segs.append(f"M{_f(fr.x(i + dx))} {_f(y_top)}V{_f(y_bot)}")
        if segs:
            out.append(f'<path class="span {cls}" stroke-width="{_f(width)}" d="{"".join(segs)}"/>')
    out += _hover_columns(fr, ["\n".join(t for t in (L.act_tip or f"{L.name}: no activations",
                                                      L.grad_tip or f"{L.name}: no gradient") if t)
                               for L in layers], centred=True)
    out.append('<g class="legend">')
    x = fr.px0
    for cls, label in (("act", "activations"), ("grad", "output gradients")):
        out.append(f'<rect class="{cls}" x="{_f(x)}" y="{_f(fr.height - 16)}" width="10" height="10"/>')
        out.append(f'<text x="{_f(x + 14)}" y="{_f(fr.height - 11)}" dominant-baseline="middle">{label}</text>')
        x += 24 + 7 * len(label)
    out.append("</g>")
    out.append("</svg>")
    return Markup("\n".join(out))


# --- gradient exponent histogram -------------------------------------------------------------------------


@dataclass(frozen=True)
class Marker:
    """A vertical line at a log2 value, with a short label and a tooltip."""

    at: float
    label: str
    tip: str
    cls: str = "marker"


def exponent_histogram(counts: dict[int, int], markers: Sequence[Marker], chart_id: str = "chart-grad-hist-svg",
                       floor_exponent: int = -150) -> Markup:
    """Bars of value counts per binary exponent e (2^e <= |g| < 2^(e+1)), log count scale, with markers.

    Bars left of the first marker flagged ``flush`` (class ``cls == "marker flush"``) are drawn as flushed.
    """
    keys = sorted(k for k, v in counts.items() if v > 0 and k > floor_exponent)
    below = sum(v for k, v in counts.items() if k <= floor_exponent)
    xs = keys + [m.at for m in markers]
    lo = math.floor(min(xs)) - 1 if xs else -30
    hi = math.ceil(max(xs)) + 2 if xs else 0
    top = max((counts[k] for k in keys), default=1)
    ymax = max(1, math.ceil(math.log10(top + 1)))
    fr = _Frame(lo, hi, 0, ymax)
    out = _open(chart_id, "Gradient exponents",
                "How many gradient values (of the loss with respect to each leaf module's output, FP32 reference) "
                "fall in each binary exponent bucket [2^e, 2^(e+1)), log count scale, with FP16's limits at loss "
                "scale 1 and at the recommended scale.")
    yt = [(float(d), _count_label(10 ** d)) for d in range(0, ymax + 1)]
    step = max(2, _nice_step((hi - lo) / 12))
    xt = [(float(e), _pow2_label(e)) for e in range(math.ceil(lo / step) * step, hi + 1, step)]
    out += _axes(fr, yt, xt, "gradient magnitude (binary exponent e of 2^e)", "values (log count)")
    flush_at = next((m.at for m in markers if "flush" in m.cls.split()), None)
    bw = max((fr.px1 - fr.px0) / (hi - lo) - 1, 1)
    out.append('<g class="bars">')
    for k in keys:
        c = counts[k]
        cls = "bar flushed" if (flush_at is not None and k + 1 <= flush_at) else "bar"
        y = fr.y(math.log10(c + 1))
        out.append(f'<rect class="{cls}" x="{_f(fr.x(k))}" y="{_f(y)}" width="{_f(bw)}" height="{_f(fr.py0 - y)}">'
                   f'<title>{c:,} value(s) in [2^{k}, 2^{k + 1})</title></rect>')
    out.append("</g>")
    out.append('<g class="markers">')
    for j, m in enumerate(markers):
        x = _f(fr.x(m.at))
        out.append(f'<line class="{escape(m.cls)}" x1="{x}" x2="{x}" y1="{_f(fr.py0)}" y2="{_f(fr.py1)}">'
                   f'<title>{escape(m.tip)}</title></line>')
        out.append(f'<text class="marker-label" x="{_f(fr.x(m.at) + 3)}" y="{_f(fr.py1 + 10 + 13 * j)}">'
                   f'{escape(m.label)}</text>')
    out.append("</g>")
    if below:
        out.append(f'<text class="note" x="{_f(fr.px1 + 16)}" y="{_f(fr.py0)}">'
                   f'{below:,} below 2^{floor_exponent + 1}</text>')
    out.append("</svg>")
    return Markup("\n".join(out))


def _count_label(c: int) -> str:
    """1, 10, 100, 1k, ... 10M: a count short enough for the axis margin (10,000,000 was clipped)."""
    for div, suffix in ((10**12, "T"), (10**9, "G"), (10**6, "M"), (10**3, "k")):
        if c >= div:
            return f"{c // div}{suffix}"
    return str(c)


# --- time per layer --------------------------------------------------------------------------------------


def time_by_layer(names: Sequence[str], times: dict[str, list[float | None]], chart_id: str = "chart-time-svg",
                  label: str = "estimated time", units: Units = ()) -> Markup:
    """Per layer, one thin bar per format for its (estimated) time in seconds, log scale."""
    vals = [v for s in times.values() for v in s if v is not None and v > 0]
    lo = math.floor(math.log10(min(vals))) if vals else -6
    hi = math.ceil(math.log10(max(vals))) if vals else -3
    hi = max(min(hi, 308), lo + 1)  # 10.0 ** 309 overflows; a time near 1.8e308 s is drawn at the top
    n = len(names)
    fr = _Frame(-0.5, max(n - 0.5, 0.5), lo, hi)
    out = _open(chart_id, f"{label.capitalize()} per layer per format",
                f"For each layer, one bar per format: its {label} in seconds, log scale.")
    yt = [(float(d), _seconds(10.0 ** d)) for d in range(lo, hi + 1)]
    if units:
        out += _tree_axis(fr, units)
    out += _axes(fr, yt, [] if units else _x_ticks_for_layers(n),
                 UNIT_AXIS_LABEL if units else "layer (in the order its forward started)", f"{label} (log)")
    k = max(len(times), 1)
    slot = (fr.px1 - fr.px0) / max(n, 1)
    bw = slot * 0.8 / k
    as_bars = bw >= 1.5  # below that, grouped bars blur into one mass: draw one dot per layer and format
    for j, (fmt, series) in enumerate(times.items()):
        segs = []
        for i, v in enumerate(series):
            if v is None or v <= 0:
                continue
            y = _f(fr.y(math.log10(v)))
            if as_bars:
                segs.append(f"M{_f(fr.x(i) - slot * 0.4 + (j + 0.5) * bw)} {_f(fr.py0)}V{y}")
            else:
                segs.append(f"M{_f(fr.x(i))} {y}h0")
        if segs:
            cls = f"tbar {series_class(fmt)}" if as_bars else f"dots small {series_class(fmt)}"
            width = f' stroke-width="{_f(bw)}"' if as_bars else ""
            out.append(f'<path class="{cls}"{width} d="{"".join(segs)}"/>')
    tips = []
    for i, name in enumerate(names):
        parts = [f"#{i} {name or '(model)'}: {label}"]
        parts += [f"{fmt} {'—' if (t := s[i]) is None else _seconds(t)}" for fmt, s in times.items()]
        tips.append("\n".join(parts))
    out += _hover_columns(fr, tips, centred=True)
    out += _legend(fr, [(f"series {series_class(f)}", f) for f in times])
    out.append("</svg>")
    return Markup("\n".join(out))


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    if s >= 1e-6:
        return f"{s * 1e6:.3g} µs"
    return f"{s * 1e9:.3g} ns"


# --- loss curves -----------------------------------------------------------------------------------------


def loss_curves(curves: dict[str, list[float | None]], chart_id: str = "chart-verify-svg") -> Markup:
    """Loss per training step for each run (FP32, the policy, plain BF16/FP16 autocast...), linear scale.

    A non-finite loss (None) breaks the line and is marked with a cross at the top.
    """
    vals = [v for s in curves.values() for v in s if v is not None]
    lo, hi = (min(vals), max(vals)) if vals else (0.0, 1.0)
    # A loss near +-1.8e308 (a schema-valid audit.json may hold one) is drawn at the frame's edge: keeping the
    # frame within +-max/16 keeps hi - lo, the ticks' (hi - lo) * 5 and every coordinate finite.
    lim = sys.float_info.max / 16
    lo, hi = min(max(lo, -lim), lim), min(max(hi, -lim), lim)
    pad = (hi - lo) * 0.08 or max(abs(hi) * 0.05, 1e-6)
    lo, hi = lo - pad, hi + pad
    n = max((len(s) for s in curves.values()), default=1)
    fr = _Frame(0, max(n - 1, 1), lo, hi)
    out = _open(chart_id, "Verification loss curves",
                "Training loss per step from the same initial weights, one line per run; a cross at the top "
                "marks a non-finite loss.")
    yt = [(lo + (hi - lo) * k / 5, _num(lo + (hi - lo) * k / 5)) for k in range(6)]
    xt = [(float(i), str(i)) for i in range(0, n, max(1, _nice_step((n - 1) / 10)))]
    out += _axes(fr, yt, xt, "training step", "loss")
    for name, s in curves.items():
        cls = series_class(name)
        seg: list[str] = []
        segs: list[list[str]] = []
        for i, v in enumerate(s):
            if v is None:
                if seg:
                    segs.append(seg)
                seg = []
                x, y = fr.x(i), fr.py1 + 4
                out.append(f'<path class="series {cls} cross" d="M{_f(x - 4)} {_f(y - 4)}L{_f(x + 4)} {_f(y + 4)}'
                           f'M{_f(x - 4)} {_f(y + 4)}L{_f(x + 4)} {_f(y - 4)}"><title>{escape(name)} step {i}: '
                           f'non-finite loss</title></path>')
            else:
                seg.append(f"{_f(fr.x(i))},{_f(fr.y(v))}")
        if seg:
            segs.append(seg)
        for sg in segs:
            out.append(f'<polyline class="series {cls}" points="{" ".join(sg)}">'
                       f'<title>{escape(name)}</title></polyline>')
    out += _legend(fr, [(f"series {series_class(k)}", k) for k in curves])
    out.append("</svg>")
    return Markup("\n".join(out))
