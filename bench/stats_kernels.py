"""Micro-benchmark of the fused statistics kernels (capture/stats.py; docs/performance.md, "Statistics: one read
per tensor"): ``range_stats`` with the edges (MagnitudeHistogram), without them (RangeSummary), ``error_sums``
(ErrorStats), at the sizes an audit sees, per dtype. Prints ns per element (median of repeats) at torch's thread
count. Needs the compiled library (``precision-audit build-kernels``).

    python bench/stats_kernels.py [--sizes 49152,196608,786432,2097152] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from precision_audit.capture import stats
from precision_audit.emulation import compiled


def _time(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="49152,196608,786432,2097152")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    if not compiled.load():
        raise SystemExit("the compiled kernels are not built: precision-audit build-kernels")
    ops = compiled.ops()
    edges = stats.boundaries()
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}; ns per element (median of {args.repeats})")
    print(f"{'elements':>9} {'dtype':>9} {'hist':>7} {'hist relu':>9} {'summary':>8} {'errors':>7}")
    for n in (int(s) for s in args.sizes.split(",")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(n) * 0.05).to(dtype)
            relu = torch.relu(x)
            ref = torch.randn(n) * 0.05
            p = (ref + torch.randn(n) * 1e-3).to(dtype)
            row = [_time(lambda x=x: ops.range_stats(x, edges), args.repeats),
                   _time(lambda r=relu: ops.range_stats(r, edges), args.repeats),
                   _time(lambda x=x: ops.range_stats(x, None), args.repeats),
                   _time(lambda r=ref, p=p: ops.error_sums(r, p), args.repeats)]
            ns = [t / n * 1e9 for t in row]
            print(f"{n:>9} {str(dtype).removeprefix('torch.'):>9} {ns[0]:>7.2f} {ns[1]:>9.2f} {ns[2]:>8.2f} "
                  f"{ns[3]:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
