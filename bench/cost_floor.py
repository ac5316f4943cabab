"""The floor under P1 (issues 14 and 33): the bare passes an emulated audit's figures need, with no statistics, hooks
or bookkeeping, in units of one FP32 training step, beside the time the model file itself takes to load.

    python bench/cost_floor.py /tmp/rmb/llama/model.py --batch /tmp/rmb/llama/sample.pt [--repeats 3]
    python bench/cost_floor.py MODEL.py --batch SAMPLE.pt --audit OUT/audit.json   # the passes that audit ran

The model and batch files are those of bench/real_models.py (``real_models.prepare(name, folder)`` writes them;
bench/README.md shows the command). What the default audit (fp16 and bf16, emulated, on a CPU with T threads)
measures, and the least compute each figure takes (docs/plan.md, docs/performance.md):

- the FP32 reference: one forward and backward at T threads (1 step);
- each format's pass: one emulated forward and backward at T threads;
- each computing module re-run alone per format on its FP32 inputs: at least one emulated forward per format
  (counted as one no-grad emulated forward of the whole model, a lower bound: a module that computes beside its
  children is re-run with them);
- the FP32 noise floor: one no-grad FP32 forward at the second thread count T' (always);
- the second reduction order where a decision needs it (docs/plan.md, "Noise floor"): one no-grad emulated forward
  at T' per format re-checked; and where the planner needs its impacts there, the FP32 forward and backward at T'
  (the audit's backward there computes the module outputs' gradients only: counted as a full one, an upper bound on
  that part alone) and the re-runs per format at T';
- the mixed plan's verification: one emulated forward of the plan's default format per verification pass at T, and
  one at T' per pass re-checked there.

Without ``--audit`` every part of the second order is counted (the audit before issue 33 ran them all) and no
verification; with it, the parts that audit.json says ran (``noise_floor.second_order``, ``planner_impacts``,
``rechecks``, the mixed candidate's ``verification_passes``). Every part is timed on its own (median of
``--repeats`` after a warm-up) in one process, with the emulation's compiled kernels when they are built (else the
Python ones: the script says which). Loading is the import of the model file, ``build_model()`` and ``torch.load`` of
the batch, timed in a fresh subprocess (an audit pays it; bench/real_models.py's P1 leaves it out). Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
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
t2 = time.perf_counter()
torch.load(sys.argv[2])
print(t1 - t, t2 - t1, time.perf_counter() - t2)
'''


def _median(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def needed(audit: dict | None) -> dict:
    """What the second reduction order and the verification cost that audit (all of the second order, no
    verification, without one): formats re-checked at T', whether the planner's impacts ran there, the plan's
    verification passes at T and at T'."""
    if audit is None:
        return {"rechecked": None, "impacts": True, "verify": 0, "verify_second": 0, "default": None}
    nf = audit.get("noise_floor") or {}
    mixed = next((c for c in audit["plan"]["candidates"] if c["label"] == "mixed"), None)
    verify = mixed["verification_passes"] if mixed else 0
    second = sum(1 for r in nf.get("rechecks") or [] if r["decision"].startswith("the mixed plan's verification")
                 and r["rechecked"])
    return {"rechecked": sorted(nf.get("second_order") or {}),
            "impacts": (nf.get("planner_impacts") or "").startswith("each module's"),
            "verify": verify, "verify_second": second if nf.get("rechecks") is not None else verify,
            "default": mixed["default_format"] if mixed else None}


def main() -> None:
    import torch

    from precision_audit.emulation import compiled
    from precision_audit.emulation.autocast import CudaAutocastPolicy, emulated_autocast
    from precision_audit.loading import load_batch, load_model, resolve_loss

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--audit", default=None, help="audit.json of the audit whose passes to count (see above)")
    args = ap.parse_args()
    need = needed(json.loads(Path(args.audit).read_text()) if args.audit else None)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-c", LOAD, args.model, args.batch], capture_output=True, text=True, env=env,
                       check=True, cwd=ROOT)  # in ROOT: `python -c` puts the working folder first on sys.path
    import_s, build_s, batch_s = map(float, p.stdout.split()[-3:])

    # the model, its batch and its loss as the audit resolves them (precision_audit/loading): a dict batch, a
    # tuple or a tensor, the model's own loss or the file's loss_fn
    model, source = load_model(args.model)
    batch = load_batch(args.batch, model, source)
    spec = resolve_loss(source, model(*batch.args, **batch.kwargs), batch)
    threads = torch.get_num_threads()
    second = 1 if threads > 1 else 2
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}

    def step(ctx=contextlib.nullcontext):
        model.zero_grad(set_to_none=True)
        with ctx():
            out = model(*batch.args, **batch.kwargs)
        spec(out, batch).float().backward()

    def forward(ctx=contextlib.nullcontext):
        with torch.no_grad(), ctx():
            model(*batch.args, **batch.kwargs)

    def at(n: int, fn):
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return _median(fn, args.repeats)
        finally:
            torch.set_num_threads(old)

    def emulated(name: str):
        return lambda: forward(lambda: emulated_autocast(dtypes[name]))

    kernels = compiled.resolve("auto")
    parts: dict[str, float] = {}
    rechecked = list(dtypes) if need["rechecked"] is None or need["impacts"] else need["rechecked"]
    with CudaAutocastPolicy(kernels):
        parts["FP32 step"] = at(threads, step)
        for name, d in dtypes.items():
            parts[f"{name} step"] = at(threads, lambda d=d: step(lambda: emulated_autocast(d)))
            parts[f"{name} re-runs (>= 1 forward)"] = at(threads, emulated(name))
        if need["impacts"]:  # the noise floor's FP32 forward is the repeat's own then (docs/performance.md)
            parts[f"FP32 step at {second} thread(s)"] = at(second, step)
        else:
            parts[f"FP32 forward at {second} thread(s) (noise floor)"] = at(second, forward)
        for name in dtypes:
            fwd = at(second, emulated(name)) if need["impacts"] or name in rechecked else 0.0
            if need["impacts"]:
                parts[f"{name} re-runs at {second} thread(s)"] = fwd
            if name in rechecked:
                parts[f"{name} forward at {second} thread(s)"] = fwd
        if need["verify"]:
            parts[f"{need['verify']} verification forward(s) ({need['default']})"] = \
                need["verify"] * at(threads, emulated(need["default"]))
        if need["verify_second"]:
            parts[f"{need['verify_second']} verification forward(s) at {second} thread(s)"] = \
                need["verify_second"] * at(second, emulated(need["default"]))
    unit = parts["FP32 step"]
    floor = sum(parts.values())
    print(f"{Path(args.model).parent.name}: {threads} threads, second order at {second}; kernels: {kernels}; "
          f"counted: {'every part of the second order' if args.audit is None else need}")
    for k, v in parts.items():
        print(f"  {k:44s} {v:7.3f} s  {v / unit:5.2f} steps")
    load = import_s + build_s + batch_s
    print(f"  {'floor after loading':44s} {floor:7.3f} s  {floor / unit:5.2f} steps")
    print(f"  {'loading (import + build_model + torch.load)':44s} {load:7.3f} s  {load / unit:5.2f} steps "
          f"(import {import_s:.2f} s, build {build_s:.2f} s, batch {batch_s:.3f} s)")
    print(f"  {'floor with loading':44s} {floor + load:7.3f} s  {(floor + load) / unit:5.2f} steps")
    print(json.dumps({"model": Path(args.model).parent.name, "threads": threads, "kernels": kernels,
                      "needed": need, "parts_s": parts, "step_s": unit, "floor_s": floor,
                      "floor_steps": floor / unit, "load_s": load, "floor_with_loading_steps": (floor + load) / unit}))


if __name__ == "__main__":
    main()
