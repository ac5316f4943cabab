"""Exactness of the streamed statistics against brute-force casts and fp64 formulas."""

from __future__ import annotations

import math

import pytest
import torch

from precision_audit.capture import stats
from precision_audit.capture.stats import SCALE_EXPONENTS, ErrorStats, MagnitudeHistogram
from precision_audit.errors import OptionError
from precision_audit.formats import SPECS, Format, headroom_bits, parse_format

FP16_BOUNDARIES = [2.0**-25, 2.0**-24, 2.0**-14, 65504.0, 65519.0, 65520.0]


def _neighbours(values):
    """Each value, and the float32 values right next to it."""
    t = torch.tensor(values, dtype=torch.float32)
    up = torch.nextafter(t, torch.full_like(t, math.inf))
    down = torch.nextafter(t, torch.zeros_like(t))
    return torch.cat([t, up, down, -t, -up])


def _brute(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> dict[str, float]:
    """Count by casting every element: the independent reference."""
    x = x[torch.isfinite(x) & (x != 0)]
    y = (x * scale).to(dtype).float()
    fi = torch.finfo(dtype)
    flushed = (y == 0).sum().item()
    overflow = (~torch.isfinite(y)).sum().item()
    sub = ((y != 0) & torch.isfinite(y) & (y.abs() < fi.smallest_normal)).sum().item()
    n = x.numel()
    return {"flushed": flushed / n, "subnormal": sub / n, "overflow": overflow / n}


def test_planted_fp16_boundaries_match_brute_force_cast():
    x = _neighbours(FP16_BOUNDARIES)
    h = MagnitudeHistogram()
    h.update(x)
    assert h.fractions(Format.FP16) == pytest.approx(_brute(x, torch.float16), abs=0), \
        "histogram fractions must equal an element-wise fp16 cast count exactly"
    # the planted values themselves, one by one: 2^-25 ties to 0, 65519 rounds to 65504, 65520 to inf
    assert torch.tensor(2.0**-25).half().item() == 0.0
    assert torch.tensor(65519.0).half().item() == 65504.0
    assert math.isinf(torch.tensor(65520.0).half().item())


@pytest.mark.parametrize("k", [-8, 0, 3, 10, 16, 24])
def test_fractions_at_loss_scales_match_brute_force(k):
    g = torch.cat([_neighbours([math.ldexp(v, -k) for v in FP16_BOUNDARIES]),
                   torch.randn(5000) * 1e-6, torch.randn(5000) * 1e3])
    h = MagnitudeHistogram()
    h.update(g)
    assert h.fractions(Format.FP16, k) == pytest.approx(_brute(g, torch.float16, 2.0**k), abs=0)


@pytest.mark.parametrize("fmt", [Format.BF16, Format.FP16, Format.FP8_E5M2], ids=str)
def test_other_formats_random_magnitudes_match_brute_force(fmt):
    s = SPECS[fmt]
    x = torch.cat([torch.exp(torch.empty(20000).uniform_(-150, 90)) * torch.sign(torch.randn(20000)),
                   _neighbours([s.zero_below, s.normal_from, s.overflow_from, s.max, s.min_subnormal])])
    x = x[torch.isfinite(x)]
    h = MagnitudeHistogram()
    h.update(x)
    assert h.fractions(fmt) == pytest.approx(_brute(x, s.dtype), abs=0)


def test_e4m3_thresholds_follow_round_to_nearest_even():
    s = SPECS[Format.FP8_E4M3]
    # 464 is the tie between 448 (even mantissa) and 480 (not representable): it rounds to 448.
    assert s.overflow_from > 464.0
    assert s.overflow_from == float(torch.nextafter(torch.tensor(464.0), torch.tensor(500.0)))
    assert torch.tensor(464.0).to(torch.float8_e4m3fn).float().item() == 448.0
    sub = torch.tensor([s.zero_below, s.normal_from]).to(torch.float8_e4m3fn).float()
    assert sub[0].item() == s.min_subnormal and sub[1].item() == s.min_normal


def test_histogram_counts_specials_and_merges():
    a, b = MagnitudeHistogram(), MagnitudeHistogram()
    a.update(torch.tensor([0.0, float("nan"), float("inf"), 1.0, -3.0]))
    b.update(torch.tensor([70000.0, 0.0]))
    a.merge(b)
    assert (a.total, a.zeros, a.nans, a.infs, a.nonzero_finite) == (7, 2, 1, 1, 3)
    assert a.amax == 70000.0
    assert a.fractions(Format.FP16)["overflow"] == pytest.approx(1 / 3)
    assert a.exponent_histogram() == {0: 1, 1: 1, 16: 1}


def test_count_below_refuses_a_value_that_is_not_an_edge():
    with pytest.raises(ValueError, match="not a histogram edge"):
        MagnitudeHistogram().count_below(3.0)


def test_scale_range_covers_gradscaler_default():
    assert 16 in SCALE_EXPONENTS and 0 in SCALE_EXPONENTS


def test_sqnr_and_friends_equal_the_fp64_formulas():
    torch.manual_seed(1)
    ref = torch.randn(3000)
    p = (ref + 1e-3 * torch.randn(3000)).to(torch.bfloat16)
    e = ErrorStats()
    e.update(ref[:1000], p[:1000])
    e.update(ref[1000:], p[1000:])  # streamed over two calls
    r, q = ref.double(), p.double()
    sqnr = 10 * math.log10(float((r * r).sum()) / float(((q - r) ** 2).sum()))
    assert e.sqnr_db == pytest.approx(sqnr, rel=1e-12)
    assert e.rel_l2 == pytest.approx(float((q - r).norm() / r.norm()), rel=1e-12)
    assert e.cosine == pytest.approx(float(torch.dot(r, q) / (r.norm() * q.norm())), rel=1e-12)
    assert e.max_abs == pytest.approx(float((q - r).abs().max()), rel=0)


def test_error_stats_nonfinite_is_a_failure_not_a_small_number():
    e = ErrorStats()
    e.update(torch.ones(4), torch.tensor([1.0, float("inf"), 1.0, float("nan")]))
    assert e.nonfinite == 2
    assert math.isinf(e.rel_l2) and e.sqnr_db == -math.inf and math.isnan(e.cosine)


def test_exact_match_has_infinite_sqnr_and_zero_error():
    e = ErrorStats()
    x = torch.randn(10)
    e.update(x, x.clone())
    assert e.rel_l2 == 0.0 and e.sqnr_db == math.inf and e.cosine == pytest.approx(1.0)


def test_headroom_bits_and_format_names():
    assert headroom_bits(Format.FP16, 65504 / 8) == pytest.approx(3.0)
    assert headroom_bits(Format.FP16, 0.0) is None
    assert parse_format("BF16") is Format.BF16 and parse_format("half") is Format.FP16
    with pytest.raises(OptionError, match="unknown format") as ei:
        parse_format("fp12")
    assert "fp16" in str(ei.value) and "bf16" in str(ei.value)


@pytest.mark.parametrize("fmt", [Format.FP16, Format.BF16, Format.FP8_E5M2, Format.FP8_E4M3], ids=str)
def test_limits_come_from_torch_finfo(fmt):
    s, fi = SPECS[fmt], torch.finfo(SPECS[fmt].dtype)
    assert (s.max, s.min_normal) == (float(fi.max), float(fi.smallest_normal))
    # the smallest subnormal really is representable, and half of it flushes to zero
    assert torch.tensor(s.min_subnormal).to(s.dtype).float().item() == s.min_subnormal
    assert torch.tensor(s.min_subnormal / 2).to(s.dtype).float().item() == 0.0


def test_threshold_counts_follow_every_change_of_the_counts():
    """count_below / fractions read running sums kept between calls (capture/stats.py, _cumulative): they must
    follow an update, a merge, an in-place write (a collective's result copied back) and a new counts tensor,
    always equal to a fresh sum over the counts."""
    h = MagnitudeHistogram()
    h.update(torch.tensor([1e-9, 3.0, 70000.0, 1e-3]))

    def fresh(t: float) -> int:
        return int(h.counts[: stats._edge_index()[t] + 1].sum())

    edges = [stats._as_edge(v) for v in (2.0 ** -30, 2.0 ** -24, 1.0, 65520.0)]
    for change in (lambda: h.update(torch.tensor([0.5, 0.25])),
                   lambda: h.merge(h.__class__(counts=h.counts.clone())),
                   lambda: h.counts.copy_(h.counts * 3),
                   lambda: setattr(h, "counts", torch.ones_like(h.counts))):
        before = [h.count_below(t) for t in edges]
        assert before == [fresh(t) for t in edges]
        change()
        after = [h.count_below(t) for t in edges]
        assert after == [fresh(t) for t in edges] and after != before
        assert h.nonzero_finite == int(h.counts.sum())
        f = h.fractions(Format.FP16)
        assert f["overflow"] == (h.nonzero_finite - fresh(stats._as_edge(65520.0))) / h.nonzero_finite


def test_exponent_histogram_sums_each_binade():
    h = MagnitudeHistogram()
    x = torch.tensor([1.0, 1.5, 1.9999, 65504.0, 65519.0, 65520.0, 3e-39, 0.75, 0.0, float("nan")])
    h.update(x)
    want: dict[int, int] = {}
    for v in x.tolist():
        if v and math.isfinite(v):
            e = math.floor(math.log2(abs(v))) if abs(v) >= 2.0 ** -149 else -150
            want[e] = want.get(e, 0) + 1
    assert h.exponent_histogram() == want
