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

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

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


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept): the median of the pairwise slopes, then the median of y - slope x."""
    x, y = np.asarray([xs], dtype=np.float64), np.asarray([ys], dtype=np.float64)
    slope, intercept = _theil_sen_rows(x, y)
    return float(slope[0]), float(intercept[0])


def _theil_sen_rows(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Theil-Sen per row of (k, w) arrays, NaN marking the readings a row lacks (a slope of 0 for a row with no
    pair of distinct steps)."""
    i, j = _pairs(x.shape[1])
    dx = x[:, j] - x[:, i]
    with np.errstate(invalid="ignore", divide="ignore"):
        slopes = np.where(dx != 0, (y[:, j] - y[:, i]) / dx, np.nan)
    slope = _median_rows(slopes, empty=0.0)
    return slope, _median_rows(y - slope[:, None] * x)


def _median_rows(a: np.ndarray, empty: float = math.nan) -> np.ndarray:
    """The median of each row's non-NaN values (the mean of the middle two for an even count, as
    ``statistics.median``); ``empty`` for a row without any."""
    s = np.sort(a, axis=1)  # NaN sorts last
    c = (~np.isnan(a)).sum(axis=1)
    lo = np.take_along_axis(s, np.maximum((c - 1) // 2, 0)[:, None], axis=1)[:, 0]
    hi = np.take_along_axis(s, np.minimum(c // 2, a.shape[1] - 1)[:, None], axis=1)[:, 0]
    return np.where(c > 0, 0.5 * (lo + hi), empty)


@functools.lru_cache(maxsize=64)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    i, j = np.triu_indices(n, 1)
    return i, j


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def fit_crossing(steps: Sequence[float], values: Sequence[float], *, limit: float, now: float, horizon: float,
                 rising: bool = True) -> Crossing | None:
    """Fit ``values`` (finite) against ``steps`` and forecast when the line crosses ``limit``: from below when
    ``rising`` (an amax reaching a format's maximum), from above otherwise. None with fewer than
    :data:`MIN_POINTS` finite readings or no spread of steps (module docstring: what the fit assumes)."""
    return fit_crossings([(steps, values, limit, rising)], now=now, horizon=horizon)[0]


def fit_crossings(series: Sequence[tuple[Sequence[float], Sequence[float] | np.ndarray, float, bool]], *, now: float,
                  horizon: float) -> list[Crossing | None]:
    """:func:`fit_crossing` for several series at once, each (steps, values, limit, rising): the medians of all
    the fits are taken together (the watch fits every watched module at each reading, so this is the host's
    share of a watched step)."""
    if not series:
        return []
    k, w = len(series), max(len(s[0]) for s in series)
    x, y = np.full((k, w), np.nan), np.full((k, w), np.nan)
    for r, (steps, values, _, rising) in enumerate(series):
        x[r, :len(steps)] = steps
        # mirror: a falling series crossing a floor is a rising one crossing a ceiling
        y[r, :len(values)] = values if rising else np.negative(np.asarray(values, dtype=np.float64))
    finite = np.isfinite(y) & np.isfinite(x)
    x, y = np.where(finite, x, np.nan), np.where(finite, y, np.nan)
    n = finite.sum(axis=1)
    slope, intercept = _theil_sen_rows(x, y)
    sigma = 1.4826 * _median_rows(np.abs(y - (intercept[:, None] + slope[:, None] * x)))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_x = np.nansum(x, axis=1) / n
    sxx = np.nansum((x - mean_x[:, None]) ** 2, axis=1)
    top = np.nanmax(np.abs(np.where(finite, y, 0.0)), axis=1)
    return [_crossing(float(slope[r]), float(intercept[r]), float(sigma[r]), int(n[r]), float(mean_x[r]),
                      float(sxx[r]), float(top[r]), s[2] if s[3] else -s[2], s[3], now, horizon)
            if n[r] >= MIN_POINTS else None for r, s in enumerate(series)]


def _crossing(slope: float, intercept: float, sigma: float, n: int, mean_x: float, sxx: float, top: float,
              limit: float, rising: bool, now: float, horizon: float) -> Crossing | None:
    """One fitted line's crossing of ``limit`` (mirrored already for a falling series)."""
    if sxx <= 0:
        return None
    # a floor on the noise: readings that sit exactly on a line (a synthetic trend, a constant) still get an
    # interval, and the "trending" test below does not divide by zero
    sigma = max(sigma, 1e-6 * max(1.0, top))
    slope_se = sigma / math.sqrt(sxx)
    ahead = now + horizon
    conf = _phi((intercept + slope * ahead - limit) / (sigma * math.sqrt(1.0 + 1.0 / n
                                                                      + (ahead - mean_x) ** 2 / sxx)))
    sign = 1.0 if rising else -1.0
    if slope <= Z * slope_se:  # flat, noisy or moving away from the limit: no crossing is forecast
        return Crossing(sign * slope, sign * intercept, sigma, None, None, None, conf, n)
    step = (limit - intercept) / slope
    low, high = _band_crossings(slope, limit - intercept - slope * mean_x, Z * sigma, 1.0 + 1.0 / n, sxx)
    # the interval as searched: from this reading on (a line already past the limit: from its crossing), and no
    # later than 50 x the distance from the readings' middle to the crossing (further is "not within reach")
    low = max(low + mean_x, now if step > now else step)
    high = high + mean_x
    return Crossing(sign * slope, sign * intercept, sigma, step, low,
                    high if high <= step + 50 * (step - mean_x + 1) else None, conf, n)


def _band_crossings(slope: float, gap: float, zs: float, c: float, sxx: float) -> tuple[float, float]:
    """Where the prediction band's edges meet the limit, in steps from the readings' mean step u: the upper edge
    (line + zs sqrt(c + u^2/sxx)) at the first root, the lower edge at the second, of

        (slope u - gap)^2 = zs^2 (c + u^2 / sxx),   gap = limit - the line's value at the mean step.

    Both edges increase in u when slope > zs / sqrt(sxx) (the trending test: each meets the limit once), so these
    are the two roots of the quadratic, in order (computed in the cancellation-free form)."""
    a = slope * slope - zs * zs / sxx
    b = slope * gap
    c0 = gap * gap - zs * zs * c
    disc = math.sqrt(max(b * b - a * c0, 0.0))
    q = b + math.copysign(disc, b) if b != 0 else disc
    if q == 0:
        return 0.0, 0.0
    r1, r2 = q / a, c0 / q
    return (r1, r2) if r1 <= r2 else (r2, r1)
