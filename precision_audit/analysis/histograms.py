"""A capture's magnitude histograms read once into Python: range fractions and exponent counts without torch ops.

:class:`~precision_audit.capture.stats.MagnitudeHistogram` answers each question with torch ops on its bucket
counts: a float32 conversion and a slice sum per threshold, a sum for the denominator, about ten small ops and
30 µs for one ``fractions`` dict. The analysis asks a dozen of them per module (every range format's fractions,
the gradients' at two loss scales, two exponent histograms): on a 162-module model that was 0.15 s of every
analysis, and an audit analyses up to four times (planning/second_order.py). :class:`Counts` reads the counts once
(``tolist``) into prefix sums and answers from them: the same integer counts and the same divisions, so the same
floats (tests/analysis/test_histograms.py checks it against ``MagnitudeHistogram``'s own methods on every format,
at every loss scale). The bucket edges and each threshold's place among them are found once per process.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from ..capture.stats import MagnitudeHistogram, boundaries
from ..formats import SPECS, Format


@functools.cache
def _edges() -> tuple[dict[float, int], tuple[int, ...]]:
    """Each edge's index, and the binary exponent e of each bucket (2^e <= its values), from the capture's edges."""
    edges = boundaries().tolist()
    index = {v: i for i, v in enumerate(edges)}
    lower = [0.0, *edges]  # bucket i holds edge[i-1] <= |x| < edge[i]
    exps = tuple(math.floor(math.log2(v)) if v > 0 else -150 for v in lower)
    return index, exps


@functools.cache
def _threshold_indices(fmt: Format, scale_exponent: int) -> tuple[int, int, int]:
    """The edge indices of ``fmt``'s flush, normal and overflow thresholds for values scaled by 2^scale_exponent
    (each threshold divided by the scale and stored as a float32 edge, as stats.py counts them)."""
    s = SPECS[fmt]
    return tuple(_edge_index(math.ldexp(t, -scale_exponent))  # type: ignore[return-value]
                 for t in (s.zero_below, s.normal_from, s.overflow_from))


def _edge_index(t: float) -> int:
    t32 = float(torch.tensor(t, dtype=torch.float32))  # the float32 value the edge list holds
    i = _edges()[0].get(t32)
    if i is None:
        raise ValueError(f"{t32!r} is not a histogram edge; only exact rounding thresholds are counted")
    return i


class Counts:
    """One :class:`MagnitudeHistogram`'s counts as Python integers, for the questions the analysis asks of it. Made
    from a finished histogram: later updates of it are not seen."""

    __slots__ = ("_cum", "_counts")

    def __init__(self, h: MagnitudeHistogram) -> None:
        self._counts: list[int] = h.counts.tolist()
        self._cum = list(itertools.accumulate(self._counts))

    @property
    def nonzero_finite(self) -> int:
        return self._cum[-1]

    def count_below(self, t: float) -> int:
        """``MagnitudeHistogram.count_below``: non-zero finite values with |x| < t, t one of the edges."""
        i = _edges()[0].get(t)
        if i is None:
            raise ValueError(f"{t!r} is not a histogram edge; only exact rounding thresholds are counted")
        return self._cum[i]

    def count_at_or_above(self, t: float) -> int:
        return self._cum[-1] - self.count_below(t)

    def fractions(self, fmt: Format, scale_exponent: int = 0) -> dict[str, float]:
        """``MagnitudeHistogram.fractions``: the shares of the non-zero finite values that, times
        2^scale_exponent and stored in ``fmt``, flush to zero, are subnormal, or overflow."""
        cum = self._cum
        n = cum[-1]
        if n == 0:
            return {"flushed": 0.0, "subnormal": 0.0, "overflow": 0.0}
        z, s, o = _threshold_indices(fmt, scale_exponent)
        below_zero = cum[z]
        return {"flushed": below_zero / n, "subnormal": (cum[s] - below_zero) / n, "overflow": (n - cum[o]) / n}

    def exponent_histogram(self) -> dict[int, int]:
        """``MagnitudeHistogram.exponent_histogram``: counts by binary exponent, in the order of the buckets."""
        exps, counts = _edges()[1], self._counts
        out: dict[int, int] = {}
        for i in itertools.compress(range(len(counts)), counts):  # the non-empty buckets
            e = exps[i]
            out[e] = out.get(e, 0) + counts[i]
        return out
