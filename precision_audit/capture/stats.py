"""Streamed tensor statistics: exact range counts and error sums, updated call by call.

Nothing here keeps a tensor. A :class:`MagnitudeHistogram` counts |x| into buckets whose edges include
every rounding threshold of every range format, at every power-of-two loss scale the audit considers,
so "what fraction would flush to zero in FP16 at loss scale 2^k" is an exact count, not an estimate.

Two implementations of every update, with the same results (docs/performance.md, "Statistics: one read per tensor"):

- **fused** (CPU tensors, when the compiled library of emulation/compiled.py is loaded): one C++ pass per
  tensor (``range_stats``, ``error_sums`` in ``_emulation_kernels.cpp``) reads each element once and yields
  the bucket counts, zeros, NaNs, infs and the largest finite magnitude together (buckets found from the float's
  exponent bits, not by a binary search), or every error sum together, accumulated in double from the
  float32 values (exact products, no float64 copy of the tensors). Counts are identical to the Python path's;
  sums differ only in summation order (relative ~1e-16).
- **Python** (any device, and whenever the library is not loaded): torch ops, as before. A tensor of more than
  :data:`CHUNK` elements is read a block at a time (:func:`blocks`), so that the float64 and mask temporaries of
  one statistic stay a block's size, not several times the tensor's: on a GPU these temporaries on the largest
  output (a language model's logits) set the audit's peak memory (docs/memory.md, "Statistics' temporaries").
  The counts are the same; the float64 sums differ from one whole-tensor sum only in their summation order. The
  reference operand of :meth:`ErrorStats.update` and :func:`dot64` may be on the host while the other is on a
  GPU: each block is copied to the GPU as it is read (no full-size copy of the reference on the GPU).

:func:`python_statistics` forces the Python path (tests compare the two).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from itertools import accumulate

import torch

from ..emulation import compiled
from ..formats import RANGE_FORMATS, SPECS, Format
from ..runtime.attribution import stored_values  # the controller reads sparse gradients the same way

# The fused path is used when the compiled library is loaded and the tensors are on the CPU; False forces the
# Python path (see python_statistics()).
FUSED = True


@contextlib.contextmanager
def python_statistics() -> Iterator[None]:
    """Inside: every statistic is computed by the Python (torch ops) path, even where the fused one is loaded."""
    global FUSED
    saved, FUSED = FUSED, False
    try:
        yield
    finally:
        FUSED = saved


def _fused(*tensors: torch.Tensor):
    """The compiled ops namespace when the fused path applies to these tensors, else None."""
    if not FUSED or not compiled.is_loaded():
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in _FUSED_DTYPES:
            return None
    return compiled.ops()


_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: Elements per block of the Python path (2^21: a float64 temporary of one block is 16 MiB).
CHUNK = 1 << 21


def blocks(shape: torch.Size | tuple[int, ...], chunk: int | None = None) -> Iterator[tuple]:
    """Indices that cut a tensor of ``shape`` into blocks of at most ``chunk`` elements (default :data:`CHUNK`),
    in memory order: slices of the leading dimension (views of a contiguous tensor), going one dimension in where
    a single leading index holds more than a block. ``()`` (the whole tensor) when it is no larger than one."""
    chunk = chunk or CHUNK
    n = math.prod(shape)
    if n <= chunk or not shape:
        yield ()
        return
    inner = n // shape[0]
    if inner <= chunk:
        rows = max(1, chunk // inner)
        for i in range(0, shape[0], rows):
            yield (slice(i, i + rows),)
        return
    for i in range(shape[0]):
        for rest in blocks(shape[1:], chunk):
            yield (i, *rest)


def dot64(a: torch.Tensor, b: torch.Tensor) -> float:
    """``sum(a * b)`` with float64 products and accumulation: ``float((a.double() * b.double()).sum())``, which the
    fused pass computes in one read of each operand and no float64 copies (its last bits follow its own summation
    order). The first-order loss impact <dL/dy, y_p - y> (docs/plan.md)."""
    ops = _fused(a, b) if a.shape == b.shape else None
    if ops is not None:
        return float(ops.dot64(a.detach(), b.detach()))
    a, b = a.detach(), b.detach()
    if a.shape != b.shape or a.numel() <= CHUNK:
        return float((a.double() * b.to(a.device).double()).sum())
    # computed on a's device, b copied a block at a time (it may be a reference kept on the host: copied as it is,
    # then widened on the device, so the copy is a plain one ordered on the stream after the one that filled it);
    # summed as plain floats, so that +inf in one block and -inf in another give NaN as one sum does
    total = 0.0
    for i in blocks(a.shape):
        total += float((a[i].double() * b[i].to(a.device).double()).sum())
    return total


def is_fused() -> bool:
    """Whether CPU statistics are computed by the fused pass now."""
    return FUSED and compiled.is_loaded()

# Loss scales 2^k considered for FP16 gradients. GradScaler starts at 2^16; models that overflow back off
# below 1, and tiny gradients may want up to 2^40.
SCALE_EXPONENTS: tuple[int, ...] = tuple(range(-24, 49))


def _thresholds(fmt: Format) -> tuple[float, float, float]:
    s = SPECS[fmt]
    return s.zero_below, s.normal_from, s.overflow_from


@cache
def _boundary_list() -> tuple[float, ...]:
    edges: set[float] = set()
    # Powers of two give the exponent histogram (for charts and percentiles).
    for e in range(-149, 128):
        edges.add(math.ldexp(1.0, e))
    for fmt in RANGE_FORMATS:
        edges.update(_thresholds(fmt))
    # FP16 gradient thresholds at every candidate loss scale S = 2^k: |g| * S crosses t  <=>  |g| crosses t / S.
    for k in SCALE_EXPONENTS:
        for t in _thresholds(Format.FP16):
            edges.add(math.ldexp(t, -k))
    # Every edge must be an exact float32 so comparisons against float32 data are exact.
    as32 = torch.tensor(sorted(edges), dtype=torch.float64).to(torch.float32)
    return tuple(sorted(set(float(v) for v in as32.tolist() if v > 0)))


@cache
def boundaries(device: str = "cpu") -> torch.Tensor:
    return torch.tensor(_boundary_list(), dtype=torch.float32, device=device)


@cache
def _edge_index() -> dict[float, int]:
    return {v: i for i, v in enumerate(_boundary_list())}


def nonfinite_where(x: torch.Tensor) -> torch.Tensor:
    """Where ``x`` is not finite: a bool mask of a strided tensor; for a sparse one, the sorted flat (row-major)
    positions, in the dense tensor it stands for, of its non-finite stored elements (two sparse gradients of one
    parameter may store different positions, so their masks could not be compared element by element)."""
    if x.layout == torch.strided:
        return ~torch.isfinite(x)
    coo = (x if x.layout == torch.sparse_coo else x.to_sparse_coo()).coalesce()
    values = coo.values()
    bad = (~torch.isfinite(values)).reshape(values.shape[0], -1)  # [nnz, dense elements]
    sparse_shape = coo.shape[:coo.sparse_dim()]
    strides = torch.tensor([math.prod(sparse_shape[i + 1:]) for i in range(len(sparse_shape))], dtype=torch.int64)
    row = (coo.indices() * strides[:, None]).sum(0)  # flat index of each stored sparse position
    nz, inner = bad.nonzero(as_tuple=True)
    return (row[nz] * bad.shape[1] + inner).sort().values


def nonfinite_elements(x: torch.Tensor) -> int:
    """How many elements of ``x`` are inf or NaN, counted a block at a time (:func:`blocks`): a sum of one bool mask
    over the whole tensor makes an int64 copy of it on CUDA (8 bytes an element)."""
    x = x.detach()
    if x.layout != torch.strided:
        return int(nonfinite_where(x).numel())
    return sum(int((~torch.isfinite(x[i] if i else x)).sum()) for i in blocks(x.shape))


def surely_finite(x: torch.Tensor) -> bool:
    """True when no element of ``x`` (a strided floating-point tensor) is inf or NaN, False when one may be: the
    fused range pass counts them exactly (one read, no sum); elsewhere a finite sum says none (an inf or NaN would
    make it inf or NaN), and a sum that overflows says maybe, for the caller's exact count to decide."""
    x = x.detach()
    ops = _fused(x) if x.dtype != torch.float64 else None  # float64 beyond float32's range would read as inf
    if ops is not None and x.layout == torch.strided:
        if x.numel() == 0:
            return True
        _, special, _ = ops.range_stats(x, None)
        _, nans, infs = special.tolist()
        return nans + infs == 0
    return bool(torch.isfinite(x.sum()))


def count_nonfinite_pairs(bad: torch.Tensor, ref: torch.Tensor | None) -> tuple[int, int]:
    """(non-finite positions of ``bad`` where ``ref`` is finite, those where it is not), both from
    :func:`nonfinite_where` of the same parameter's gradients; all of ``bad`` when ``ref`` does not match it."""
    if bad.dtype == torch.bool:
        if ref is None or ref.dtype != torch.bool or ref.shape != bad.shape:
            return int(bad.sum()), 0
        return int((bad & ~ref).sum()), int((bad & ref).sum())
    if ref is None or ref.dtype == torch.bool:
        return bad.numel(), 0
    shared = int(torch.isin(bad, ref).sum())
    return bad.numel() - shared, shared


@dataclass
class MagnitudeHistogram:
    """Exact counts of |x| between consecutive edges of :func:`boundaries`, plus special values.

    ``counts[i]`` holds finite non-zero values with ``edge[i-1] <= |x| < edge[i]`` (``counts[0]``: below the
    first edge). Zeros, NaNs and infs are counted apart.
    """

    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(len(_boundary_list()) + 1, dtype=torch.int64))
    total: int = 0
    zeros: int = 0
    nans: int = 0
    infs: int = 0
    amax: float = 0.0  # largest finite |x|

    def update(self, x: torch.Tensor) -> None:
        x = x.detach()
        if x.layout != torch.strided:
            self._update_sparse(x)
            return
        n = x.numel()
        if n == 0:
            return
        ops = _fused(x)
        if ops is not None:
            counts, special, amax = ops.range_stats(x, boundaries())
            zeros, nans, infs = special.tolist()
            self.total += n
            self.zeros += zeros
            self.nans += nans
            self.infs += infs
            self.amax = max(self.amax, amax)  # 0.0 when no finite value is non-zero, as below
            self.counts += counts
            return
        for i in blocks(x.shape):
            self._update_python(x[i] if i else x)

    def _update_sparse(self, x: torch.Tensor) -> None:
        """A sparse tensor (an ``nn.Embedding(sparse=True)`` gradient) counted as the dense tensor it stands for,
        without making it: its stored values, plus one zero for every element it does not store."""
        values = stored_values(x)
        self.update(values)
        implicit = x.numel() - values.numel()
        self.total += implicit
        self.zeros += implicit

    def _update_python(self, x: torch.Tensor) -> None:
        n = x.numel()
        a = x.abs().flatten()
        if a.dtype != torch.float32:
            a = a.float()  # exact: every fp16/bf16/fp8 value is a float32 value; fp64 beyond fp32 range is rare
        self.total += n
        if not bool(torch.isfinite(a).all()):
            self.nans += int(torch.isnan(a).sum())
            self.infs += int(torch.isinf(a).sum())
            a = a[torch.isfinite(a)]
            if a.numel() == 0:
                return
        # zeros land in bucket 0 (0 < the first edge) and are taken out of it again
        zeros = int((a == 0).sum())
        self.zeros += zeros
        if zeros == a.numel():
            return
        self.amax = max(self.amax, float(a.max()))
        idx = torch.bucketize(a, boundaries(str(a.device)), right=True)
        counts = torch.bincount(idx, minlength=self.counts.numel()).cpu()
        counts[0] -= zeros
        self.counts += counts

    def merge(self, other: MagnitudeHistogram) -> None:
        self.counts += other.counts
        _merge_specials(self, other)

    def _cumulative(self) -> list[int]:
        """The running sums of ``counts`` as Python ints, kept until ``counts`` changes: the analysis asks each
        histogram for a dozen thresholds in every format (a torch sum over a slice each, 8000 in a 12-layer model's
        audit). Keyed by the tensor and its version counter, which every in-place change (``+=``, ``copy_``, a
        collective's result written back) increments; a tensor without one (made under inference_mode) is summed
        each time."""
        c = self.counts
        try:
            key = (id(c), c._version)
        except RuntimeError:
            return list(accumulate(c.tolist()))
        hit = self.__dict__.get("_cum")
        if hit is not None and hit[0] == key and hit[1] is c:
            return hit[2]
        cum = list(accumulate(c.tolist()))
        self.__dict__["_cum"] = (key, c, cum)
        return cum

    @property
    def nonzero_finite(self) -> int:
        return self._cumulative()[-1]

    @property
    def nonfinite(self) -> int:
        return self.nans + self.infs

    def count_below(self, t: float) -> int:
        """Non-zero finite values with |x| < t; t must be one of the histogram's edges."""
        i = _edge_index().get(t)
        if i is None:
            raise ValueError(f"{t!r} is not a histogram edge; only exact rounding thresholds are counted")
        return self._cumulative()[i]

    def count_at_or_above(self, t: float) -> int:
        return self.nonzero_finite - self.count_below(t)

    def fractions(self, fmt: Format, scale_exponent: int = 0) -> dict[str, float]:
        """Shares of the non-zero finite values that, multiplied by 2^scale_exponent and stored in ``fmt``,
        flush to zero, land in the subnormal range, or overflow. Denominator: non-zero finite values."""
        n = self.nonzero_finite
        if n == 0:
            return {"flushed": 0.0, "subnormal": 0.0, "overflow": 0.0}
        zb, nf, of = _scaled_edges(fmt, scale_exponent)
        below_zero = self.count_below(zb)
        below_normal = self.count_below(nf)
        overflow = n - self.count_below(of)
        return {
            "flushed": below_zero / n,
            "subnormal": (below_normal - below_zero) / n,
            "overflow": overflow / n,
        }

    def quantile_bounds(self, q: float) -> float:
        """An upper bound (a bucket's upper edge) on the q-quantile of the non-zero finite |x|."""
        n = self.nonzero_finite
        if n == 0:
            return 0.0
        target = q * n
        csum = torch.cumsum(self.counts, 0)
        i = int(torch.searchsorted(csum, torch.tensor(target, dtype=csum.dtype).ceil().to(csum.dtype)))
        edges = _boundary_list()
        return edges[min(i, len(edges) - 1)]

    def exponent_histogram(self) -> dict[int, int]:
        """Counts by binary exponent e, for values with 2^e <= |x| < 2^(e+1) (for charts)."""
        exponents = _bucket_exponents()
        out: dict[int, int] = {}
        for i, c in enumerate(self.counts.tolist()):
            if c:
                e = exponents[i]
                out[e] = out.get(e, 0) + c
        return out


@dataclass
class RangeSummary:
    """Largest finite magnitude and special-value counts only: for the low-precision passes, whose range
    fractions are not needed (the FP32 histograms predict them exactly), this skips the bucket counts."""

    total: int = 0
    zeros: int = 0
    nans: int = 0
    infs: int = 0
    amax: float = 0.0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach()
        if x.numel() == 0:
            return
        ops = _fused(x) if x.dtype != torch.float64 else None  # float64 is kept in float64 below
        if ops is not None:
            _, special, amax = ops.range_stats(x, None)
            zeros, nans, infs = special.tolist()
            self.total += x.numel()
            self.zeros += zeros
            self.nans += nans
            self.infs += infs
            self.amax = max(self.amax, amax)
            return
        for i in blocks(x.shape):
            self._update_python(x[i] if i else x)

    def _update_python(self, x: torch.Tensor) -> None:
        a = x.abs()
        self.total += a.numel()
        finite = torch.isfinite(a)
        if not bool(finite.all()):
            self.nans += int(torch.isnan(a).sum())
            self.infs += int(torch.isinf(a).sum())
            a = a[finite]
        if a.numel():
            self.zeros += int((a == 0).sum())
            self.amax = max(self.amax, float(a.max()))

    def merge(self, other: RangeSummary) -> None:
        _merge_specials(self, other)

    @property
    def nonfinite(self) -> int:
        return self.nans + self.infs


def _merge_specials(a: MagnitudeHistogram | RangeSummary, b: MagnitudeHistogram | RangeSummary) -> None:
    a.total += b.total
    a.zeros += b.zeros
    a.nans += b.nans
    a.infs += b.infs
    a.amax = max(a.amax, b.amax)


@cache
def _as_edge(t: float) -> float:
    """The float32 value of t, which is how it is stored in the edge list."""
    return float(torch.tensor(t, dtype=torch.float32))


@cache
def _scaled_edges(fmt: Format, scale_exponent: int) -> tuple[float, float, float]:
    """The edges of ``fmt``'s three thresholds at loss scale 2^scale_exponent (flush, normal, overflow)."""
    zb, nf, of = (_as_edge(math.ldexp(t, -scale_exponent)) for t in _thresholds(fmt))
    return zb, nf, of


@cache
def _bucket_exponents() -> tuple[int, ...]:
    """The binary exponent e (2^e <= |x| < 2^(e+1)) of each bucket's lower edge, -150 for bucket 0 (for charts)."""
    edges = _boundary_list()
    out = [-150]
    for lower in edges:
        out.append(math.floor(math.log2(lower)) if lower > 0 else -150)
    return tuple(out)


@dataclass
class ErrorStats:
    """Sums for error metrics of y_p against the reference y, accumulated in float64 over calls."""

    n: int = 0
    sum_ref2: float = 0.0
    sum_diff2: float = 0.0
    sum_dot: float = 0.0
    sum_p2: float = 0.0
    max_abs: float = 0.0
    nonfinite: int = 0  # non-finite elements in y_p where y is finite
    # Elements where the reference y itself is not finite: left out of every metric above, so that a format is
    # judged only on what it adds to FP32 (docs/report.md, "FP32's own non-finite values").
    ref_nonfinite: int = 0

    def update(self, ref: torch.Tensor, p: torch.Tensor) -> None:
        if ref.shape != p.shape:
            raise ValueError(f"shape mismatch {tuple(ref.shape)} vs {tuple(p.shape)}")
        ops = _fused(ref, p)
        if ops is not None:
            n = ref.numel()
            self.n += n
            if n == 0:
                return
            flags, sums = ops.error_sums(ref.detach(), p.detach())
            ref_bad, bad = flags.tolist()
            self.ref_nonfinite += ref_bad
            if ref_bad == n:
                return
            self.nonfinite += bad
            s_r2, s_d2, s_dot, s_p2, max_abs = sums.tolist()
            self.sum_ref2 += s_r2
            self.sum_diff2 += s_d2
            self.sum_dot += s_dot
            self.sum_p2 += s_p2
            self.max_abs = max(self.max_abs, max_abs)  # as the Python path: a NaN here is kept only if first
            return
        ref, p = ref.detach(), p.detach()
        most: list[float] = []
        for i in blocks(ref.shape):  # computed on p's device (a reference on the host is copied block by block)
            r, q = (ref[i], p[i]) if i else (ref, p)
            self._update_python(r.to(q.device), q, most)
        # as one whole-tensor max: a NaN difference anywhere leaves max_abs as it was (nonfinite says why)
        if most and not any(math.isnan(v) for v in most):
            self.max_abs = max(self.max_abs, *most)

    def _update_python(self, ref: torch.Tensor, p: torch.Tensor, most: list[float]) -> None:
        r = ref.to(torch.float64).flatten()
        q = p.to(r.device, torch.float64).flatten()
        self.n += r.numel()
        if r.numel() == 0:
            return
        finite_ref = torch.isfinite(r)
        if not bool(finite_ref.all()):
            self.ref_nonfinite += int((~finite_ref).sum())
            r, q = r[finite_ref], q[finite_ref]
            if r.numel() == 0:
                return
        if not bool(torch.isfinite(q).all()):
            self.nonfinite += int((~torch.isfinite(q)).sum())
        d = q - r
        self.sum_ref2 += float(torch.dot(r, r))
        self.sum_diff2 += float(torch.dot(d, d))
        self.sum_dot += float(torch.dot(r, q))
        self.sum_p2 += float(torch.dot(q, q))
        most.append(float(d.abs().max()))

    def merge(self, o: ErrorStats) -> None:
        self.n += o.n
        self.sum_ref2 += o.sum_ref2
        self.sum_diff2 += o.sum_diff2
        self.sum_dot += o.sum_dot
        self.sum_p2 += o.sum_p2
        self.max_abs = max(self.max_abs, o.max_abs)
        self.nonfinite += o.nonfinite
        self.ref_nonfinite += o.ref_nonfinite

    @property
    def rel_l2(self) -> float:
        if self.nonfinite:
            return math.inf
        if self.sum_ref2 == 0:
            return 0.0 if self.sum_diff2 == 0 else math.inf
        return math.sqrt(self.sum_diff2 / self.sum_ref2)

    @property
    def sqnr_db(self) -> float:
        if self.nonfinite:
            return -math.inf
        if self.sum_diff2 == 0:
            return math.inf
        if self.sum_ref2 == 0:
            return -math.inf
        return 10.0 * math.log10(self.sum_ref2 / self.sum_diff2)

    @property
    def cosine(self) -> float:
        if self.nonfinite:
            return math.nan
        den = math.sqrt(self.sum_ref2 * self.sum_p2)
        if den == 0:
            return 1.0 if self.sum_ref2 == self.sum_p2 else 0.0
        return self.sum_dot / den

    def metrics(self) -> dict[str, float]:
        return {"rel_l2": self.rel_l2, "sqnr_db": self.sqnr_db,
                "max_abs": self.max_abs if not self.nonfinite else math.inf,
                "cosine": self.cosine, "nonfinite": self.nonfinite, "elements": self.n}
