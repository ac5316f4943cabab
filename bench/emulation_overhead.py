"""P2: emulated BF16/FP16 training step vs the FP32 step, and vs CPU-native autocast, measured in one run.

    python bench/emulation_overhead.py [--model sample_models/mlp/model.py] [--batch sample_models/mlp/sample.pt]
                                       [--repeats 50] [--scale-batch 1]

Goal: emulated step <= 1.5x the FP32 step. Prints medians and ratios; nothing here is a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from precision_audit.capture.emulation import CudaAutocastPolicy, emulated_autocast  # noqa: E402
from precision_audit.loading import load_batch, load_model, resolve_loss  # noqa: E402


def timed(step, repeats: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "sample_models" / "mlp" / "model.py"))
    ap.add_argument("--batch", default=str(ROOT / "sample_models" / "mlp" / "sample.pt"))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--scale-batch", type=int, default=1, help="repeat the batch along dim 0 this many times")
    ap.add_argument("--native", action="store_true", help="also time CPU-native autocast (slow: ~100x for GEMMs)")
    ap.add_argument("--probe", action="store_true",
                    help="use DESIGN.md §3's probe instead: an 8-block residual MLP, 512 wide, batch 128")
    args = ap.parse_args()

    if args.probe:
        args.model = str(ROOT / "bench" / "models" / "residual_mlp.py")
        args.batch = None
    model, source = load_model(args.model)
    batch = load_batch(args.batch, model, source)
    if args.scale_batch > 1:
        rep = lambda t: t.repeat(args.scale_batch, *([1] * (t.dim() - 1))) if isinstance(t, torch.Tensor) else t  # noqa: E731
        batch = type(batch)(args=tuple(rep(a) for a in batch.args), kwargs={k: rep(v) for k, v in batch.kwargs.items()},
                            target=rep(batch.target) if batch.target is not None else None,
                            raw=tuple(rep(a) for a in batch.raw) if isinstance(batch.raw, tuple) else rep(batch.raw),
                            source=batch.source)
    spec = resolve_loss(source, model(*batch.args, **batch.kwargs), batch)

    def step(ctx):
        def run():
            model.zero_grad(set_to_none=True)
            with ctx():
                loss = spec(model(*batch.args, **batch.kwargs), batch)
            loss.backward()
        return run

    results = {"fp32": timed(step(lambda: torch.autocast("cpu", enabled=False)), args.repeats)}
    with CudaAutocastPolicy():
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            results[f"emulated {name}"] = timed(step(lambda dt=dt: emulated_autocast(dt)), args.repeats)
    if args.native:
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            results[f"cpu-native autocast {name}"] = timed(step(lambda dt=dt: torch.autocast("cpu", dtype=dt)),
                                                           max(3, args.repeats // 10))
    base = results["fp32"]
    print(f"model {args.model}  batch x{args.scale_batch}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"{'step':<26} {'median ms':>10} {'/ fp32':>8}")
    for k, v in results.items():
        print(f"{k:<26} {v * 1e3:>10.3f} {v / base:>8.2f}x")


if __name__ == "__main__":
    main()
