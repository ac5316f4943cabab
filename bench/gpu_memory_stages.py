"""The audit's peak GPU memory per stage, against one training step's (issue 14 item 2; docs/memory.md).

    python bench/gpu_memory_stages.py [--models t5,gpt2] [--batch 32]

Per model (built as bench/real_models.py builds it: transformers' default configuration, random weights, nothing
downloaded), in one process on a CUDA GPU: the peak ``torch.cuda.max_memory_allocated`` of one FP32 training step
(model, gradients, activations; the second of two, after warm-up), then the audit (default options, cuda mode)
with the peak statistics reset at each of its progress lines, so each stage's own peak is printed beside the
ratio to the training step's. The audit's timed steps reset those statistics themselves (capture/timing.py): the
"timed steps" stage shows the largest peak of its steps. Needs a GPU; bench/gpu_checks.sh runs it.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_models  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from precision_audit.audit import AuditOptions, run_audit  # noqa: E402


def step_peak(model_py: Path, sample: Path) -> int:
    spec = importlib.util.spec_from_file_location("bench_model", model_py)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.build_model().cuda()
    batch = {k: v.cuda() for k, v in torch.load(sample).items()}

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()  # the model and batch go with this frame (freed by the caller's gc)


def stages(model_py: Path, sample: Path, out: Path) -> list[tuple[str, int, float]]:
    rows: list[tuple[str, int, float]] = []
    last: list = [None, time.perf_counter()]

    def progress(msg) -> None:
        torch.cuda.synchronize()
        if last[0] is not None:
            rows.append((last[0], torch.cuda.max_memory_allocated(), time.perf_counter() - last[1]))
        torch.cuda.reset_peak_memory_stats()
        last[:] = [str(msg)[:90], time.perf_counter()]

    run_audit(AuditOptions(model=str(model_py), batch=str(sample), out=out, device="cuda"), progress)
    progress("end")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="t5,gpt2", help=f"comma-separated subset of {','.join(real_models.MODELS)}")
    ap.add_argument("--batch", type=int, default=32, help="the batch's first dimension (default 32)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_memory_stages.py: torch sees no CUDA GPU (expected one; fix: run it on a GPU "
                         "machine with a CUDA build of torch)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; batch {args.batch}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in [n.strip() for n in args.models.split(",") if n.strip()]:
            model_py, sample = real_models.prepare(name, Path(tmp), args.batch)
            step = step_peak(model_py, sample)
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            print(f"\n{name}: one training step {step / 2**20:.0f} MiB")
            worst = 0.0
            for msg, peak, dt in stages(model_py, sample, Path(tmp) / name / "out"):
                ratio = peak / step if step else float("nan")  # nan: no step peak (a fake device's counters)
                worst = max(worst, ratio)
                print(f"  {peak / 2**20:8.0f} MiB {ratio:5.2f}x {dt:6.2f} s  {msg}")
            print(f"  largest stage: {worst:.2f}x the training step (goal: at most 1.25x)")
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
