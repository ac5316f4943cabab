"""The fused statistics (capture/stats.py, ``range_stats`` / ``error_sums`` in emulation/_emulation_kernels.cpp) and
the automatic build that makes them the default (emulation/compiled.py).

The fused pass must change nothing: bucket counts, zeros, NaNs, infs and amax equal to a brute-force count and to
the Python path, error sums within summation-order rounding of them, the brute-force tests of
tests/capture/test_stats.py
passing with it, and whole audits of the sample models equal to the stored ones (tests/golden/). The Python path
is what the rest of the suite runs (conftest.py turns the automatic build off), so both are covered.
"""

from __future__ import annotations

import bisect
import logging
import math
import sys  # noqa: E402
from pathlib import Path as _Path  # noqa: E402

import pytest
import torch

sys.path.insert(0, str(_Path(__file__).resolve().parents[1] / "e2e"))  # the golden comparison
import test_stats  # noqa: E402
from conftest import ROOT, SAMPLES
from precision_audit.capture import stats
from precision_audit.capture.stats import ErrorStats, MagnitudeHistogram, RangeSummary, python_statistics
from precision_audit.emulation import compiled
from test_golden_audit import check_against_stored, read_as_stored

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.fixture(scope="module")
def fused(built_kernels):
    d, _ = built_kernels
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRECISION_AUDIT_KERNEL_DIR", str(d))
        assert compiled.load()
        assert stats.is_fused()
        yield d
    compiled._loaded = None
    assert not stats.is_fused()


def hostile(dtype: torch.dtype, n: int = 20_000) -> torch.Tensor:
    """Magnitudes over the whole float32 range, every histogram edge and its float32 neighbours below, zeros of
    both signs, subnormals, NaNs and infs of both signs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-150, 128, (n,), generator=g).double())
    e = stats.boundaries().double()
    below = torch.nextafter(stats.boundaries(), torch.zeros(1)).double()
    x = torch.cat([x, e, -below, torch.tensor([0.0, -0.0, 1e-45, -3e-44, float("nan"), float("inf"), -float("inf")],
                                              dtype=torch.float64)])
    x = x[torch.randperm(x.numel(), generator=g)]
    return x.to(dtype)


def brute_counts(x: torch.Tensor) -> tuple[list[int], int, int, int, float]:
    """Bucket i holds edge[i-1] <= |x| < edge[i] (float32 values), counted one element at a time."""
    edges = stats._boundary_list()
    counts = [0] * (len(edges) + 1)
    zeros = nans = infs = 0
    amax = 0.0
    for v in x.float().tolist():
        a = abs(v)
        if math.isnan(a):
            nans += 1
        elif math.isinf(a):
            infs += 1
        elif a == 0:
            zeros += 1
        else:
            counts[bisect.bisect_right(edges, a)] += 1
            amax = max(amax, a)
    return counts, zeros, nans, infs, amax


def test_the_automatic_build_said_so_in_one_line(built_kernels):
    _, messages = built_kernels
    building = [m for m in messages if "building the compiled kernels" in m]
    assert len(building) == 1 and "cached in" in building[0], messages


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_histogram_equals_a_brute_force_count(vector_path, dtype):
    x = hostile(dtype, 4000)
    h = MagnitudeHistogram()
    h.update(x)
    counts, zeros, nans, infs, amax = brute_counts(x)
    assert h.counts.tolist() == counts
    assert (h.total, h.zeros, h.nans, h.infs, h.amax) == (x.numel(), zeros, nans, infs, amax)


@pytest.mark.parametrize("edges", [
    [1.0, 1.0 + 2 ** -20, 1.0 + 2 ** -19, 1.0 + 3 * 2 ** -20, 2.0],  # three edges inside one cell (1, 1 + 2^-4)
    [2.0 ** -140, 2.0 ** -130, 0.75, 1.5, 1.75, 3.0],                 # subnormal edges; no power of two in most binades
    [float(2 ** k) for k in range(-126, 128)] + [1.25, 1.2500001, 40.0],  # every binade, two edges in one cell
], ids=["three-in-a-cell", "sparse", "two-in-a-cell"])
def test_bucket_counts_of_any_edge_list_equal_bucketize(vector_path, edges):
    """range_stats' buckets against torch.bucketize(right=True), for edge lists its cell table holds (at most two
    edges inside a cell) and ones it does not (the binary search), over hostile values in every chunk layout."""
    e = torch.tensor(sorted(set(edges)), dtype=torch.float32)
    x = torch.cat([hostile(torch.float32, 70_000), e, -torch.nextafter(e, torch.zeros(1)),
                   torch.nextafter(e, torch.full((1,), float("inf"))), 1.0 + torch.rand(5000) / 8])
    counts, special, amax = compiled.ops().range_stats(x, e)
    a = x.abs()
    ok = torch.isfinite(a) & (a != 0)
    want = torch.bincount(torch.bucketize(a[ok], e, right=True), minlength=e.numel() + 1)
    assert counts.tolist() == want.tolist()
    assert special.tolist() == [int((a == 0).sum()), int(a.isnan().sum()), int(a.isinf().sum())]
    assert amax == float(a[ok].max())


def test_the_audits_edges_fit_the_cell_table():
    """range_stats finds a bucket without a search when no cell of 2^19 float32 bit patterns (an exponent and the
    top four mantissa bits) holds more than two edges strictly inside it; with a third it silently takes a
    binary search per value. The edge list the audit uses must keep the fast path."""
    edges = torch.tensor(stats._boundary_list(), dtype=torch.float32).view(torch.int32).tolist()
    inside: dict[int, int] = {}
    for b in edges:
        if b >> 23 and b & ((1 << 19) - 1):  # a normal value, not at its cell's start
            inside[b >> 19] = inside.get(b >> 19, 0) + 1
    assert max(inside.values()) <= 2 and len(edges) + 2 <= 0xFFFF


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_and_python_paths_agree_on_every_field(vector_path, dtype):
    x = hostile(dtype)
    # non-contiguous and multi-chunk (the pass splits at 32768 elements) inputs too
    for t in (x, x.reshape(-1, 7)[:, ::2] if x.numel() % 7 == 0 else x[::3], x.repeat(5)):
        assert_paths_agree(t, t)


def assert_paths_agree(fused_input: torch.Tensor, python_input: torch.Tensor) -> None:
    """The histogram and the range summary of ``fused_input`` on the fused path equal those of ``python_input``
    on the Python path, field by field."""
    a, b = MagnitudeHistogram(), MagnitudeHistogram()
    a.update(fused_input)
    with python_statistics():
        b.update(python_input)
    assert torch.equal(a.counts, b.counts)
    assert (a.total, a.zeros, a.nans, a.infs, a.amax) == (b.total, b.zeros, b.nans, b.infs, b.amax)
    r1, r2 = RangeSummary(), RangeSummary()
    r1.update(fused_input)
    with python_statistics():
        r2.update(python_input)
    assert r1 == r2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_every_16_bit_pattern_reads_as_torch_converts_it(vector_path, dtype):
    """The kernels convert fp16 and bf16 with their own branch-free arithmetic: every one of the 65536 bit patterns
    (subnormals, zeros of both signs, infs, NaNs) gives the histogram, the range, the error sums and dot64 that
    torch's own conversion to float32 gives."""
    p = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    as32 = p.float()
    assert_paths_agree(p, as32)
    ref = torch.randn(p.numel(), generator=torch.Generator().manual_seed(2))
    finite = torch.isfinite(as32)
    for keep in (slice(None), finite):  # with the infs and NaNs (non-finite sums), and without (finite ones)
        a, b = ErrorStats(), ErrorStats()
        a.update(ref[keep], p[keep])
        b.update(ref[keep], as32[keep])  # the float32 path of the same kernel
        got = (a.nonfinite, a.sum_ref2, a.sum_diff2, a.sum_dot, a.sum_p2, a.max_abs)
        exp = (b.nonfinite, b.sum_ref2, b.sum_diff2, b.sum_dot, b.sum_p2, b.max_abs)
        assert all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(got, exp)), (got, exp)
    assert a.nonfinite == 0 and math.isfinite(a.sum_diff2) and a.sum_diff2 > 0
    assert stats.dot64(ref[finite], p[finite]) == stats.dot64(ref[finite], as32[finite])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_sums_agree_and_nonfinite_rules_hold(fused, dtype):
    g = torch.Generator().manual_seed(5)
    ref = torch.randn(70_001, generator=g)
    ref[::1000] = float("inf")  # the reference's own non-finite values are left out
    p = (ref + 1e-2 * torch.randn(ref.shape, generator=g)).to(dtype)
    for q, bad in ((p, 0), (p.clone().index_fill_(0, torch.tensor([5, 77]), float("nan")), 2)):
        a, b = ErrorStats(), ErrorStats()
        a.update(ref, q)
        with python_statistics():
            b.update(ref, q)
        assert (a.n, a.ref_nonfinite, a.nonfinite) == (b.n, b.ref_nonfinite, b.nonfinite) == (ref.numel(), 71, bad)
        for f in ("sum_ref2", "sum_diff2", "sum_dot", "sum_p2"):
            va, vb = getattr(a, f), getattr(b, f)
            assert va == vb or (math.isnan(va) and math.isnan(vb)) or abs(va - vb) <= 1e-12 * abs(vb), (f, va, vb)
        ma, mb = a.metrics(), b.metrics()
        for k in ma:  # the same up to summation order
            assert ma[k] == mb[k] or (math.isnan(ma[k]) and math.isnan(mb[k])) or \
                abs(ma[k] - mb[k]) <= 1e-12 * abs(mb[k]), (k, ma, mb)
        if bad:
            assert a.rel_l2 == math.inf and a.metrics()["max_abs"] == math.inf
        else:
            assert a.max_abs == b.max_abs
    same = ErrorStats()
    same.update(ref, ref.clone())
    assert same.sum_diff2 == 0 and same.sqnr_db == math.inf


def test_cuda_or_unloaded_falls_back_to_python(fused, monkeypatch):
    x = torch.randn(100)
    assert stats._fused(x) is not None
    with python_statistics():
        assert stats._fused(x) is None
    assert stats._fused(x.to(torch.int32)) is None
    monkeypatch.setattr(compiled, "_loaded", None)
    assert stats._fused(x) is None


BRUTE_FORCE_TESTS = [
    (test_stats.test_planted_fp16_boundaries_match_brute_force_cast, {}),
    *[(test_stats.test_fractions_at_loss_scales_match_brute_force, {"k": k}) for k in (-8, 0, 3, 10, 16, 24)],
    *[(test_stats.test_other_formats_random_magnitudes_match_brute_force, {"fmt": f})
      for f in (stats.Format.BF16, stats.Format.FP16, stats.Format.FP8_E5M2)],
    (test_stats.test_histogram_counts_specials_and_merges, {}),
    (test_stats.test_sqnr_and_friends_equal_the_fp64_formulas, {}),
    (test_stats.test_error_stats_nonfinite_is_a_failure_not_a_small_number, {}),
    (test_stats.test_exact_match_has_infinite_sqnr_and_zero_error, {}),
]


@pytest.mark.parametrize("test,kwargs", BRUTE_FORCE_TESTS,
                         ids=[f"{t.__name__}{kw}" for t, kw in BRUTE_FORCE_TESTS])
def test_the_brute_force_tests_of_test_stats_pass_on_the_fused_path(fused, test, kwargs, monkeypatch):
    calls = []
    real = compiled.ops

    def counting():
        calls.append(1)
        return real()

    monkeypatch.setattr(compiled, "ops", counting)
    torch.manual_seed(0)
    test(**kwargs)
    assert calls, "the test did not reach the fused path"


@pytest.mark.parametrize("name", SAMPLES)
def test_audits_with_fused_statistics_equal_the_stored_ones(fused, tmp_path, name, caplog):
    """The same comparison as tests/e2e/test_golden_audit.py (which runs the Python path), with the fused pass."""
    from precision_audit.audit import AuditOptions, run_audit

    calls = []
    real = stats.compiled.ops

    def counting():
        calls.append(1)
        return real()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiled, "ops", counting)
        run_audit(AuditOptions(model=str(ROOT / "sample_models" / name / "model.py"),
                               batch=str(ROOT / "sample_models" / name / "sample.pt"), out=tmp_path / "o",
                               kernels="python"))
    assert len(calls) > 10
    new = read_as_stored(tmp_path / "o" / "audit.json")
    assert new["options"]["kernels"] == "python"  # asked for here: the emulation's kernels stay the stored ones

    def same_kernels(stored: dict, new: dict) -> None:
        new["options"]["kernels"] = stored["options"]["kernels"]

    check_against_stored(name, new, same_kernels)


# -- the automatic build (emulation/compiled.py) ----------------------------------------------------------------


def test_auto_without_a_compiler_is_one_line_and_python(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PRECISION_AUDIT_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PRECISION_AUDIT_AUTO_BUILD", "1")
    monkeypatch.setattr(compiled, "_loaded", None)
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="precision_audit"):
        assert compiled.resolve("auto") == "python"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "building" in lines[0], lines  # the attempt, then why it fell back
    assert "no C++ compiler" in lines[1] and "using the Python kernels" in lines[1] and "\n" not in lines[1]
    assert not compiled.failure_note().exists(), "a missing compiler is checked again next time (cheap)"


def test_a_failed_automatic_compile_is_remembered_and_not_retried(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PRECISION_AUDIT_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PRECISION_AUDIT_AUTO_BUILD", "1")
    monkeypatch.setattr(compiled, "_loaded", None)
    tries = []

    def failing(verbose=False):
        tries.append(1)
        raise compiled.AuditError("building the compiled kernels failed: error: this is not C++")

    monkeypatch.setattr(compiled, "build", failing)
    with caplog.at_level(logging.WARNING, logger="precision_audit"):
        assert compiled.resolve("auto") == "python"
        assert compiled.resolve("auto") == "python"
    assert len(tries) == 1 and compiled.failure_note().is_file()
    assert "earlier automatic build failed" in caplog.records[-1].getMessage()


def test_auto_build_off_uses_python_without_trying(tmp_path, monkeypatch):
    monkeypatch.setenv("PRECISION_AUDIT_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PRECISION_AUDIT_AUTO_BUILD", "0")
    monkeypatch.setattr(compiled, "_loaded", None)
    monkeypatch.setattr(compiled, "build", lambda verbose=False: pytest.fail("must not build"))
    assert compiled.resolve("auto") == "python"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the ELF library's dynamic symbols")
def test_the_statistics_kernels_run_on_torchs_threads(fused):
    """at::parallel_for in range_stats/error_sums is ATen's OpenMP version: without -fopenmp it compiles to one
    thread (the statistics took as long at 2 threads as at 1). The library is built with OpenMP: it calls
    GOMP_parallel, from the libgomp torch has loaded (no second OpenMP runtime in the process)."""
    lib = compiled.library_path()
    assert b"GOMP_parallel" in lib.read_bytes()
    gomps = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
    assert len(gomps) == 1 and "torch" in next(iter(gomps)), gomps


def test_a_compiler_without_openmp_still_builds_the_kernels(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setenv("PRECISION_AUDIT_KERNEL_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(compiled, "_loaded", None)
    monkeypatch.setattr(cpp_extension, "verify_ninja_availability", lambda: None)
    calls = []

    def load(name, sources, build_directory, extra_cflags=(), extra_ldflags=(), **kw):
        calls.append(list(extra_cflags) + list(extra_ldflags))
        if "-fopenmp" in calls[-1]:
            raise RuntimeError("clang: error: unsupported option '-fopenmp'")
        (_Path(build_directory) / f"{compiled.LIBRARY_NAME}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", load)
    with caplog.at_level(logging.WARNING, logger="precision_audit"):
        path, _ = compiled.build()
    without = [f for f in compiled.BUILD_FLAGS if f != "-fopenmp"]
    assert "-fopenmp" in compiled.BUILD_FLAGS and without
    assert calls == [[*compiled.BUILD_FLAGS, "-fopenmp"], without] and path.is_file()
    assert "without OpenMP" in caplog.records[-1].getMessage()
    monkeypatch.setattr(compiled, "_loaded", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_dot64_is_the_float64_sum_of_exact_products(fused, dtype):
    """The first-order loss impact <dL/dy, y_p - y> (dL/dy float32, the diff bf16): against math.fsum of the exact
    products (the correctly rounded sum), within the error bound of a float64 summation; the same bits at 1 and 2
    threads (chunk partials added in chunk order); several chunks and a non-contiguous operand."""
    g = torch.Generator().manual_seed(5)
    n = 100_003
    a = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 30, (n,), generator=g).float())
    b = (torch.randn(2 * n, generator=g) * 1e-3)[::2].to(dtype)
    exact = math.fsum(x * y for x, y in zip(a.double().tolist(), b.double().tolist()))
    bound = n * 2.0 ** -52 * math.fsum(abs(x * y) for x, y in zip(a.double().tolist(), b.double().tolist()))
    got = stats.dot64(a, b)
    assert abs(got - exact) <= bound
    with python_statistics():
        assert abs(stats.dot64(a, b) - exact) <= bound  # the torch expression it stands for
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = stats.dot64(a, b)
    finally:
        torch.set_num_threads(old)
    assert one == got


def test_dot64_propagates_non_finite_products_as_the_float64_expression(fused):
    a = torch.tensor([1.0, 2.0, float("inf"), 3.0])
    for b in (torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 0.0, 1.0]),
              torch.tensor([1.0, float("nan"), 1.0, 1.0]), torch.tensor([1.0, -1.0, -1.0, 1.0])):
        with python_statistics():
            want = stats.dot64(a, b.bfloat16())
        got = stats.dot64(a, b.bfloat16())
        assert (math.isnan(got) and math.isnan(want)) or got == want, (b, got, want)


# -- the kernels' own orders and layouts (docs/performance.md, "Statistics: one read per tensor") ------------------


def kernel_order_sums(ref: torch.Tensor, p: torch.Tensor) -> tuple[list[float], float, int, int]:
    """error_sums' figures re-added in Python in the order the kernel promises: per 32768-element chunk, element
    lo + 4k + l into lane l (products of the float32/float64 values in double), the four lanes added left to right,
    the chunks in order from 0.0; elements whose reference is not finite left out. (sums, max_abs, ref_bad, bad)."""
    r = ref.double().tolist()
    q = p.double().tolist()
    total = [0.0, 0.0, 0.0, 0.0]
    most, nan, ref_bad, bad = 0.0, False, 0, 0
    for lo in range(0, len(r), 1 << 15):
        lanes = [[0.0] * 4 for _ in range(4)]
        for i in range(lo, min(len(r), lo + (1 << 15))):
            rv, qv = r[i], q[i]
            if not math.isfinite(rv):
                ref_bad += 1
                continue
            bad += not math.isfinite(qv)
            d = qv - rv
            lane = (i - lo) % 4
            lanes[0][lane] += rv * rv
            lanes[1][lane] += d * d
            lanes[2][lane] += rv * qv
            lanes[3][lane] += qv * qv
            if math.isnan(d):
                nan = True
            else:
                most = max(most, abs(d))
        for k in range(4):
            total[k] += ((lanes[k][0] + lanes[k][1]) + lanes[k][2]) + lanes[k][3]
    return total, (math.nan if nan else most), ref_bad, bad


def same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 4, 7, 32768, 32771, 70_001])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
def test_error_sums_are_the_bits_of_their_documented_order(fused, dtype, n, nonfinite):
    """The vectorized error sums (four lanes in a vector register) give the very bits of the scalar order
    they replace, at every length (the tail of a chunk padded with zeros), on all-finite chunks (summed without
    masks) and with non-finite references (left out: a +0.0 in their lanes) and non-finite low-precision values
    (NaN and inf sums), at 1 and 2 threads."""
    g = torch.Generator().manual_seed(n)
    ref = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())
    ref[5::1013] = -0.0
    p = (ref + 1e-3 * torch.randn(n, generator=g)).to(dtype)
    if nonfinite:
        ref[::997] = float("inf")
        p[7::1999] = float("nan")
        p[11::2003] = -float("inf")
    ops = compiled.ops()
    want_sums, want_max, want_ref_bad, want_bad = kernel_order_sums(ref, p)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            flags, sums = ops.error_sums(ref, p)
            got = sums.tolist()
            assert flags.tolist() == [want_ref_bad, want_bad]
            assert all(same_float(a, b) for a, b in zip(got[:4], want_sums)), (threads, got, want_sums)
            assert same_float(got[4], want_max)
    finally:
        torch.set_num_threads(old)


@pytest.fixture(params=[True, False], ids=["avx512", "portable"])
def vector_path(fused, request):
    """range_stats' AVX-512 loops (where the CPU has them) and the portable ones, on the same machine."""
    was = compiled.ops().set_avx512(request.param)
    if request.param and not was and not compiled.ops().set_avx512(True):
        pytest.skip("this CPU has no AVX-512")
    yield request.param
    compiled.ops().set_avx512(True)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 4095, 4097, 16383, 49_152, 65_537, 300_001])
def test_histograms_of_every_split_and_tail_equal_bucketize(vector_path, n):
    """range_stats cuts a tensor into one piece per thread (not 32768-element chunks) and each piece into blocks of
    4096 with a 16-wide vector loop and a scalar tail: the counts equal torch.bucketize at sizes around every one
    of those boundaries, at 1 and 2 threads, on values that include subnormals, zeros, infs and NaNs."""
    x = hostile(torch.float32, n)[:n] if n < 20_000 else hostile(torch.float32, n)
    e = stats.boundaries()
    a = x.abs()
    ok = torch.isfinite(a) & (a != 0)
    want = torch.bincount(torch.bucketize(a[ok], e, right=True), minlength=e.numel() + 1).tolist()
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            counts, special, amax = compiled.ops().range_stats(x, e)
            assert counts.tolist() == want, threads
            assert special.tolist() == [int((a == 0).sum()), int(a.isnan().sum()), int(a.isinf().sum())]
            assert amax == (float(a[ok].max()) if ok.any() else 0.0)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("edges", [
    [1.0, 1.0 + 2 ** -23, 1.0 + 2 ** -22, 1.0 + 3 * 2 ** -23, 1.0 + 4 * 2 ** -23, 1.0 + 5 * 2 ** -23,
     1.0 + 6 * 2 ** -23, 1.0 + 7 * 2 ** -23, 1.0 + 8 * 2 ** -23, 2.0],  # eight distinct lows: not the plane layout
    [1.5 * 2.0 ** k for k in range(-120, 120, 7)] + [1.75, 1.875],  # edges at cell starts only
], ids=["eight-lows", "cell-starts"])
def test_bucket_counts_of_other_edge_lists_equal_bucketize(vector_path, edges):
    """Edge lists beyond the plane layout's seven distinct positions inside a cell take the table or the binary
    search; ones at cell starts only have no plane at all. Both against torch.bucketize."""
    e = torch.tensor(sorted(set(edges)), dtype=torch.float32)
    x = torch.cat([hostile(torch.float32, 50_000), e, -torch.nextafter(e, torch.zeros(1)),
                   torch.nextafter(e, torch.full((1,), float("inf"))), 1.0 + torch.rand(5000) * 2 ** -20])
    counts, _, _ = compiled.ops().range_stats(x, e)
    a = x.abs()
    ok = torch.isfinite(a) & (a != 0)
    want = torch.bincount(torch.bucketize(a[ok], e, right=True), minlength=e.numel() + 1)
    assert counts.tolist() == want.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_surely_finite_is_exact_on_the_fused_path(fused, dtype):
    """format_pass's non-finite gradient check (stats.surely_finite): no inf or NaN -> True, one anywhere -> False,
    on the fused path and the Python one; a finite tensor whose sum overflows is finite on the fused path (its
    counts, exact) and "maybe" on the Python one (its sum; the caller counts exactly then)."""
    big = torch.full((70_000,), torch.finfo(dtype).max / 2, dtype=dtype)
    fused_counts = dtype != torch.float64  # float64 takes the sum (beyond float32's range it would read as inf)
    for x, by_counts, by_sum in ((torch.randn(70_001).to(dtype), True, True), (torch.zeros(0, dtype=dtype), True, True),
                                 (big, True, False)):
        assert stats.surely_finite(x) is (by_counts if fused_counts else by_sum)
        with python_statistics():
            assert stats.surely_finite(x) is by_sum
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(70_001).to(dtype)
        x[66_666] = bad
        assert stats.surely_finite(x) is False
        with python_statistics():
            assert stats.surely_finite(x) is False


def test_float64_error_sums_that_overflow_are_summed_with_the_masks(fused):
    """A float64 pair whose squares overflow a double: the unmasked pass's sums are not finite, so the chunk is
    summed again with the masks, which gives the inf sums (and the counts) the documented order gives."""
    ref = torch.tensor([1e200, 1.0, -3.0, float("inf"), 2e-300], dtype=torch.float64)
    p = torch.tensor([-1e200, 1.5, float("nan"), 1.0, 0.0], dtype=torch.float64)
    flags, sums = compiled.ops().error_sums(ref, p)
    want_sums, want_max, ref_bad, bad = kernel_order_sums(ref, p)
    assert flags.tolist() == [ref_bad, bad] == [1, 1]
    assert all(same_float(a, b) for a, b in zip(sums.tolist()[:4], want_sums)) and math.isinf(want_sums[0])
    assert same_float(sums.tolist()[4], want_max)


def test_the_order_test_tells_orders_apart(fused):
    """The documented order is checked on data where other orders give other bits: a sequential sum, or the lanes
    added pairwise ((s0 + s1) + (s2 + s3)) differ from it in at least one sum of these single chunks, and the
    kernel still gives the documented bits."""
    seen_other = set()
    for seed in (0, 1, 2):
        g = torch.Generator().manual_seed(seed)
        ref = torch.randn(32_771, generator=g)
        p = ref + 1e-3 * torch.randn(ref.shape, generator=g)
        want, _, _, _ = kernel_order_sums(ref, p)
        _, sums = compiled.ops().error_sums(ref, p)
        assert sums.tolist()[:4] == want
        r, q = ref.double().tolist(), p.double().tolist()
        lanes = [[0.0] * 4 for _ in range(4)]
        seq = [0.0] * 4
        for i, (rv, qv) in enumerate(zip(r, q)):
            d = qv - rv
            terms = (rv * rv, d * d, rv * qv, qv * qv)
            for k, t in enumerate(terms):
                lanes[k][i % 4] += t
                seq[k] += t
        for k in range(4):
            s = lanes[k]
            if (s[0] + s[1]) + (s[2] + s[3]) != want[k]:
                seen_other.add("pairwise")
            if seq[k] != want[k]:
                seen_other.add("sequential")
    assert seen_other == {"pairwise", "sequential"}
