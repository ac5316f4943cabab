"""The floor under P1 (issue 14): the bare passes an emulated audit's figures need, with no statistics, hooks or
bookkeeping, in units of one FP32 training step, beside the time the model file itself takes to load.

    python bench/cost_floor.py /tmp/rmb/llama/model.py --batch /tmp/rmb/llama/sample.pt [--repeats 3]

The model and batch files are those of bench/real_models.py (``real_models.prepare(name, folder)`` writes them;
bench/README.md shows the command). What the default audit (fp16 and bf16, emulated, on a CPU with T threads)
measures, and the least compute each figure takes (docs/plan.md, docs/performance.md):

- the FP32 reference: one forward and backward at T threads (1 step);
- each format's pass: one emulated forward and backward at T threads;
- each computing module re-run alone per format on its FP32 inputs: at least one emulated forward per format
  (counted as one no-grad emulated forward of the whole model, a lower bound: a module that computes beside its
  children is re-run with them);
- the second reduction order (the noise floor and the planner's impacts at both orders, issue 12): the FP32
  forward and backward at the second thread count T' (the audit's backward there computes the module outputs'
  gradients only: counted as a full one, an upper bound on that part alone), the re-runs per format at T', and one
  forward per format at T'.

Every part is timed on its own (median of ``--repeats`` after a warm-up) in one process, with the emulation's
compiled kernels when they are built (else the Python ones: the script says which). Loading is the import of the
model file and ``build_model()``, timed in a fresh subprocess (an audit pays it; bench/real_models.py's P1 counts
it, its FP32 step does not). Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LOAD = r'''
import sys, time, importlib.util
import torch, transformers  # noqa: F401  (imported before timing, as bench/real_models.py's children do)
import precision_audit  # noqa: F401
t = time.perf_counter()
spec = importlib.util.spec_from_file_location("floor_model", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
t1 = time.perf_counter()
mod.build_model()
print(t1 - t, time.perf_counter() - t1)
'''


def _median(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    import torch

    from precision_audit.emulation import compiled
    from precision_audit.emulation.autocast import CudaAutocastPolicy, emulated_autocast

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", LOAD, args.model], capture_output=True, text=True, env=env, check=True)
    import_s, build_s = map(float, p.stdout.split()[-2:])

    spec = importlib.util.spec_from_file_location("floor_model", args.model)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.build_model()
    batch = torch.load(args.batch)
    threads = torch.get_num_threads()
    second = 1 if threads > 1 else 2
    dtypes = (torch.float16, torch.bfloat16)

    def loss(out):
        return out.loss if hasattr(out, "loss") else out[0] if isinstance(out, tuple) else out

    def step(ctx=contextlib.nullcontext):
        model.zero_grad(set_to_none=True)
        with ctx():
            out = model(**batch)
        loss(out).float().backward()

    def forward(ctx=contextlib.nullcontext):
        with torch.no_grad(), ctx():
            model(**batch)

    def at(n: int, fn):
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return _median(fn, args.repeats)
        finally:
            torch.set_num_threads(old)

    kernels = compiled.resolve("auto")
    parts: dict[str, float] = {}
    with CudaAutocastPolicy(kernels):
        parts["FP32 step"] = at(threads, step)
        for d in dtypes:
            name = str(d).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
            parts[f"{name} step"] = at(threads, lambda d=d: step(lambda: emulated_autocast(d)))
            parts[f"{name} re-runs (>= 1 forward)"] = at(threads, lambda d=d: forward(lambda: emulated_autocast(d)))
        parts[f"FP32 step at {second} thread(s)"] = at(second, step)
        for d in dtypes:
            name = str(d).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
            fwd = at(second, lambda d=d: forward(lambda: emulated_autocast(d)))
            parts[f"{name} re-runs at {second} thread(s)"] = fwd
            parts[f"{name} forward at {second} thread(s)"] = fwd
    unit = parts["FP32 step"]
    floor = sum(parts.values())
    print(f"{Path(args.model).parent.name}: {threads} threads, second order at {second}; kernels: {kernels}")
    for k, v in parts.items():
        print(f"  {k:36s} {v:7.3f} s  {v / unit:5.2f} steps")
    load = import_s + build_s
    print(f"  {'floor after loading':36s} {floor:7.3f} s  {floor / unit:5.2f} steps")
    print(f"  {'loading (import + build_model)':36s} {load:7.3f} s  {load / unit:5.2f} steps "
          f"(import {import_s:.2f} s, build {build_s:.2f} s)")
    print(f"  {'floor with loading':36s} {floor + load:7.3f} s  {(floor + load) / unit:5.2f} steps")
    print(json.dumps({"model": Path(args.model).parent.name, "threads": threads, "kernels": kernels,
                      "parts_s": parts, "step_s": unit, "floor_steps": floor / unit, "load_s": load,
                      "floor_with_loading_steps": (floor + load) / unit}))


if __name__ == "__main__":
    main()
