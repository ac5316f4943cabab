"""analysis/histograms.py's ``Counts`` gives exactly what ``MagnitudeHistogram``'s own methods (capture/stats.py,
torch ops on the counts) give: every range format at scale 1, FP16 at every loss scale the audit considers, the
exponent histogram with its key order, the counts below and above the edges, on histograms of values spread over
float32's whole range, and on empty ones."""

from __future__ import annotations

import pytest
import torch

from precision_audit.analysis.histograms import Counts
from precision_audit.capture.stats import SCALE_EXPONENTS, MagnitudeHistogram, boundaries
from precision_audit.formats import RANGE_FORMATS, Format


def _histograms() -> dict[str, MagnitudeHistogram]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-150, 128, (20000,), generator=g).float())
    out = {}
    for name, tensors in {
        "wide": [wide, torch.tensor([0.0, float("inf"), float("nan"), -0.0])],
        "gradients": [torch.randn(5000, generator=g) * 1e-6, torch.randn(300, generator=g) * 1e3],
        "fp16 edges": [torch.tensor([2.0 ** -25, 2.0 ** -24, 6.0e-8, 2.0 ** -14, 65504.0, 65519.0, 65520.0, 1e5])],
        "zeros only": [torch.zeros(7)],
        "empty": [],
    }.items():
        h = MagnitudeHistogram()
        for t in tensors:
            h.update(t)
        out[name] = h
    return out


HISTOGRAMS = _histograms()


@pytest.mark.parametrize("name", list(HISTOGRAMS))
def test_fractions_and_exponents_equal_the_histograms_own(name):
    h = HISTOGRAMS[name]
    c = Counts(h)
    assert c.nonzero_finite == h.nonzero_finite
    for f in RANGE_FORMATS:
        assert c.fractions(f) == h.fractions(f), f
    for k in SCALE_EXPONENTS:
        assert c.fractions(Format.FP16, k) == h.fractions(Format.FP16, k), k
    for t in boundaries().tolist()[::7]:
        assert (c.count_below(t), c.count_at_or_above(t)) == (h.count_below(t), h.count_at_or_above(t)), t
    ours, theirs = c.exponent_histogram(), h.exponent_histogram()
    assert list(ours.items()) == list(theirs.items()), "same counts, same key order (audit.json's)"
    assert all(type(v) is int for v in ours.values())


def test_a_scale_without_edges_is_refused_alike():
    h = HISTOGRAMS["wide"]
    with pytest.raises(ValueError, match="not a histogram edge"):
        h.fractions(Format.BF16, 5)
    with pytest.raises(ValueError, match="not a histogram edge"):
        Counts(h).fractions(Format.BF16, 5)
    with pytest.raises(ValueError, match="not a histogram edge"):
        Counts(h).count_below(3.0)
    empty = HISTOGRAMS["empty"]
    assert Counts(empty).fractions(Format.BF16, 5) == empty.fractions(Format.BF16, 5), "no values: no edge needed"
