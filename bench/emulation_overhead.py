"""P2: emulated BF16/FP16 training step vs the FP32 step, and vs CPU-native autocast, measured in one run.

    python bench/emulation_overhead.py [--model sample_models/mlp/model.py] [--batch sample_models/mlp/sample.pt]
                                       [--repeats 50] [--rounds 9] [--scale-batch 1] [--probe] [--native]
                                       [--no-compiled]

Goal: emulated step <= 1.5x the FP32 step. Times the FP32 step and the emulated BF16/FP16 steps with the Python
kernels and with the compiled ones, in interleaved rounds, and prints the best and the median round of each with
its ratio to FP32. The compiled kernels are obtained as an audit's default (``--kernels auto``) obtains them:
loaded when built, else built once automatically (~20-40 s, needs a C++ compiler and ninja), with no manual
step. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from precision_audit.emulation import compiled  # noqa: E402
from precision_audit.emulation.autocast import CudaAutocastPolicy, emulated_autocast  # noqa: E402
from precision_audit.errors import AuditError  # noqa: E402
from precision_audit.loading import load_batch, load_model, resolve_loss  # noqa: E402


def timed_rounds(steps: dict, repeats: int, rounds: int) -> dict[str, list[float]]:
    """Per step, the mean time of ``repeats`` calls in each of ``rounds`` rounds, the steps interleaved round by
    round so that a slow spell of a shared machine hits them all alike. ``steps`` maps a name to
    (context, step); the context (e.g. a CudaAutocastPolicy) is entered around that step's round only."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, (ctx, step) in steps.items():
            with ctx():
                for _ in range(3):
                    step()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    step()
                times[name].append((time.perf_counter() - t0) / repeats)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "sample_models" / "mlp" / "model.py"))
    ap.add_argument("--batch", default=str(ROOT / "sample_models" / "mlp" / "sample.pt"))
    ap.add_argument("--repeats", type=int, default=50, help="steps per timed round (default: 50)")
    ap.add_argument("--rounds", type=int, default=9,
                    help="interleaved rounds; best and median are printed (default: 9)")
    ap.add_argument("--no-compiled", action="store_true",
                    help="time the Python kernels only (default: also the compiled ones, building them if needed)")
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

    kernel_kinds = ["python"]
    if not args.no_compiled:
        import logging

        logging.basicConfig(level=logging.WARNING, format="  %(message)s")
        was_built = compiled.is_built()
        t0 = time.perf_counter()
        try:
            kind = compiled.resolve("auto")  # the audit's default: load, or build once automatically
        except AuditError as e:
            kind = f"not measured: compiled kernels: {e.message}"
        if kind == "compiled":
            kernel_kinds.append("compiled")
            if not was_built:
                print(f"  built automatically in {time.perf_counter() - t0:.1f} s")
        else:
            print(f"  compiled kernels not measured ({kind})")

    steps = {"fp32": (contextlib.nullcontext, step(lambda: torch.autocast("cpu", enabled=False)))}
    for kinds in kernel_kinds:
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            steps[f"emulated {name}, {kinds} kernels"] = (lambda kinds=kinds: CudaAutocastPolicy(kinds),
                                                          step(lambda dt=dt: emulated_autocast(dt)))
    times = timed_rounds(steps, args.repeats, args.rounds)
    if args.native:
        for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            times[f"cpu-native autocast {name}"] = timed_rounds(
                {"x": (contextlib.nullcontext, step(lambda dt=dt: torch.autocast("cpu", dtype=dt)))},
                max(3, args.repeats // 10), 1)["x"]
    base_min, base_med = min(times["fp32"]), statistics.median(times["fp32"])
    print(f"model {args.model}  batch x{args.scale_batch}  torch {torch.__version__}  threads {torch.get_num_threads()}"
          f"  {args.rounds} rounds x {args.repeats} steps")
    print(f"{'step':<36} {'best ms':>8} {'/ fp32':>7} {'median ms':>10} {'/ fp32':>7}")
    for k, v in times.items():
        best, med = min(v), statistics.median(v)
        print(f"{k:<36} {best * 1e3:>8.3f} {best / base_min:>6.2f}x {med * 1e3:>10.3f} {med / base_med:>6.2f}x")


if __name__ == "__main__":
    main()
