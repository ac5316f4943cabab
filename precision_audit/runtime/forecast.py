"""Forecasting when a watched statistic crosses a format's limit (docs/policy.md, "Watch and forecast").

The watch (runtime/watch.py) reads, every ``watch_every`` steps, per module: the amax of its output and of its
output gradient (and for fp16 the share of gradient values below fp16's normal range at the loss scale). This
module fits the recent trend of such a series and says at which step it would cross a limit.

**What the fit assumes.** Over the last ``window`` readings the quantity (log2 of an amax, or an underflow
share) follows a straight line in the step number plus noise that does not trend: an amax growing or shrinking
by a steady *factor* per step (the usual shape of activation growth, of a learning rate schedule's effect, of a
regression target growing), or a share drifting steadily. The line is fitted robustly (Theil-Sen: the median
of the pairwise slopes, then the median intercept), so a few outlying readings (a loss spike, one odd batch) do
not bend it. The noise is taken from the residuals (1.4826 x their median absolute deviation, the standard
deviation for normal noise) and the line's uncertainty from the usual least-squares formulas applied with that
noise: the predicted value at step s has standard deviation

    sigma_pred(s) = sigma * sqrt(1 + 1/n + (s - mean_step)^2 / sum((step - mean_step)^2))

The crossing step is where the line meets the limit; its interval is where the line +/- 1.96 sigma_pred meets
it (about 95% under normal noise). The *confidence* that the limit is crossed within ``horizon`` steps is
P(value at now + horizon > limit) under a normal with the line's value and sigma_pred there. A series that is
flat or moving away from the limit (slope not above 1.96 of its standard error) is given no crossing. The fit
extrapolates: a trend that bends (saturation, a schedule's decay) is seen only as fast as the window follows it,
which is why the forecast is refreshed at every reading and acts only within a horizon.

Example::

    fc = fit_crossing([10, 20, 30, 40], [1.0, 2.0, 3.0, 4.0], limit=16.0, now=40, horizon=200)
    fc.step          # 160.0: the line reaches 16 at step 160
    fc.confidence    # ~1.0: the line is exact, so within 200 steps the limit is crossed surely
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

#: How many standard deviations make the crossing's interval and the "trending" test (about 95% two-sided).
Z = 1.96
#: The fewest readings a fit needs.
MIN_POINTS = 6


@dataclass(frozen=True)
class Crossing:
    """A fitted line and when it crosses a limit (all in the series' own units, steps for the step axis)."""

    slope: float  # per step
    intercept: float  # the line's value at step 0
    sigma: float  # the residuals' robust standard deviation
    step: float | None  # the step at which the line meets the limit (None: it does not approach it)
    low: float | None  # the earliest step of the interval (line + Z sigma_pred meets the limit)
    high: float | None  # the latest (line - Z sigma_pred meets it; None: not within the window's reach)
    confidence: float  # P(the limit is crossed by now + horizon)
    points: int

    def to_dict(self) -> dict[str, float | int | None]:
        return {"step": _round(self.step), "low": _round(self.low), "high": _round(self.high),
                "confidence": round(self.confidence, 4), "slope": float(f"{self.slope:.4g}"),
                "sigma": float(f"{self.sigma:.4g}"), "points": self.points}


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def theil_sen(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope, intercept): the median of the pairwise slopes, then the median of y - slope x."""
    slopes = [(ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
              if xs[j] != xs[i]]
    slope = statistics.median(slopes) if slopes else 0.0
    return slope, statistics.median(y - slope * x for x, y in zip(xs, ys))


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def fit_crossing(steps: list[float], values: list[float], *, limit: float, now: float, horizon: float,
                 rising: bool = True) -> Crossing | None:
    """Fit ``values`` (finite) against ``steps`` and forecast when the line crosses ``limit``: from below when
    ``rising`` (an amax reaching a format's maximum), from above otherwise. None with fewer than
    :data:`MIN_POINTS` finite readings or no spread of steps (module docstring: what the fit assumes)."""
    pts = [(float(s), float(v)) for s, v in zip(steps, values) if math.isfinite(v)]
    if len(pts) < MIN_POINTS:
        return None
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if not rising:  # mirror: a falling series crossing a floor is a rising one crossing a ceiling
        ys, limit = [-y for y in ys], -limit
    slope, intercept = theil_sen(xs, ys)
    n = len(xs)
    mean_x = sum(xs) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx <= 0:
        return None
    resid = [y - (intercept + slope * x) for x, y in zip(xs, ys)]
    sigma = 1.4826 * statistics.median(abs(r) for r in resid)
    # a floor on the noise: readings that sit exactly on a line (a synthetic trend, a constant) still get an
    # interval, and the "trending" test below does not divide by zero
    sigma = max(sigma, 1e-6 * max(1.0, max(abs(y) for y in ys)))
    slope_se = sigma / math.sqrt(sxx)

    def pred_sd(s: float) -> float:
        return sigma * math.sqrt(1.0 + 1.0 / n + (s - mean_x) ** 2 / sxx)

    ahead = now + horizon
    conf = _phi((intercept + slope * ahead - limit) / pred_sd(ahead))
    if slope <= Z * slope_se:  # flat, noisy or moving away from the limit: no crossing is forecast
        return Crossing(slope if rising else -slope, intercept if rising else -intercept, sigma, None, None, None,
                        conf, n)
    step = (limit - intercept) / slope
    low = _solve(lambda s: intercept + slope * s + Z * pred_sd(s) - limit, now if step > now else step, step)
    high = _solve(lambda s: intercept + slope * s - Z * pred_sd(s) - limit, step, step + 50 * (step - mean_x + 1))
    return Crossing(slope if rising else -slope, intercept if rising else -intercept, sigma, step, low, high,
                    conf, n)


def _solve(fn: Callable[[float], float], a: float, b: float) -> float | None:
    """The root of ``fn`` (increasing where it matters) in [a, b] by bisection: ``a`` when fn is already above 0
    there, None when it never reaches 0 before ``b``."""
    if fn(a) > 0:
        return a
    if fn(b) < 0:
        return None
    for _ in range(60):
        m = 0.5 * (a + b)
        if fn(m) < 0:
            a = m
        else:
            b = m
    return 0.5 * (a + b)
