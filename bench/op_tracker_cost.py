"""What the FP32 reference pass's op tracker (capture/op_tracker.py) adds to one forward.

    PA_DEPTH=32 PA_WIDTH=256 PA_BATCH=64 python bench/op_tracker_cost.py [--model bench/models/residual_mlp.py]
        [--rounds 11] [--threads 1]

Times one no-grad FP32 forward of the model alone and under the tracker (attributing every op to the root module,
as the audit attributes each to the innermost module running it), in interleaved rounds, and prints the medians,
the ops tracked and the cost per op.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from precision_audit.capture.calls import CallStack  # noqa: E402
from precision_audit.capture.op_tracker import OpTracker  # noqa: E402
from precision_audit.capture.records import LayerRecord  # noqa: E402


def _calls(model: torch.nn.Module) -> CallStack:
    """The part of a capture session the tracker reads: one module on the call stack, its record."""
    rec = LayerRecord("", type(model).__name__, 0, False, 0, 0, 0)
    return CallStack({id(model): ""}, {id(model): model}, lambda m: rec, stack=[id(model)], own_ops=[0],
                     own_work=[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "bench" / "models" / "residual_mlp.py"))
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = importlib.util.spec_from_file_location("bench_model", args.model)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.build_model()
    batch = mod.sample_batch()
    x = batch[0] if isinstance(batch, tuple) else batch

    def plain() -> None:
        with torch.no_grad():
            model(x)

    def tracked() -> int:
        calls = _calls(model)
        with torch.no_grad(), OpTracker(calls, model):
            model(x)
        return calls.own_ops[0]

    n_ops = tracked()
    for _ in range(3):
        plain()
        tracked()
    a: list[float] = []
    b: list[float] = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        plain()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        tracked()
        b.append(time.perf_counter() - t)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"ops tracked {n_ops}; forward {ma * 1e3:.2f} ms, under the tracker {mb * 1e3:.2f} ms: "
          f"+{(mb - ma) * 1e3:.2f} ms ({(mb - ma) / max(n_ops, 1) * 1e6:.1f} us per op)")


if __name__ == "__main__":
    main()
