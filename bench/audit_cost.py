"""P1 and P5: the whole audit against one FP32 training step, in time and in peak memory.

    python bench/audit_cost.py [--p1] [--p5] [--quick]

P1: full audit wall time / one FP32 forward+backward step (median of 5), for residual MLPs of depth 8, 32,
128 and tiny GPTs of 2, 6, 12 blocks. Goal: at most 8x at every depth, flat in depth.
P5: audit peak memory / one FP32 training step's peak, each measured in a fresh subprocess as peak RSS above
the process's RSS after the model and batch are built. Goal: at most 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "bench" / "models" / "residual_mlp.py"
GPT = ROOT / "sample_models" / "tiny_gpt" / "model.py"

CASES = [("residual MLP", "depth", d, {"PA_DEPTH": str(d), "PA_WIDTH": "256", "PA_BATCH": "64"})
         for d in (8, 32, 128)] + \
        [("tiny GPT", "blocks", b, {"PA_GPT_LAYERS": str(b)}) for b in (2, 6, 12)]


def _gpt_file(tmp: Path) -> Path:
    f = tmp / "gpt_bench.py"
    f.write_text(
        "import importlib.util, os, torch\n"
        f"spec = importlib.util.spec_from_file_location('tiny_gpt_base', {str(GPT)!r})\n"
        "base = importlib.util.module_from_spec(spec); spec.loader.exec_module(base)\n"
        "def build_model():\n"
        "    return base.build_model(n_layer=int(os.environ.get('PA_GPT_LAYERS', 2)))\n"
        "loss_fn = base.loss_fn\n"
        "def sample_batch():\n"
        "    return base.sample_batch()\n")
    return f


CHILD = r'''
import json, os, resource, sys, time, statistics
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[4])
from precision_audit.loading import load_model, load_batch, resolve_loss
what, model_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
model, src = load_model(model_path)
batch = load_batch(None, model, src)
def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
base = None
def reset_peak():
    # writing 5 to clear_refs resets VmHWM to the current RSS (Linux)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
def current():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
spec = resolve_loss(src, model(*batch.args, **batch.kwargs), batch)
model.zero_grad(set_to_none=True)
import gc; gc.collect()
reset_peak(); base = current()
if what == "step":
    times = []
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = spec(model(*batch.args, **batch.kwargs), batch)
        loss.backward()
        times.append(time.perf_counter() - t0)
    result = {"seconds": statistics.median(times)}
else:
    from precision_audit.audit import AuditOptions, run_audit
    t0 = time.perf_counter()
    run_audit(AuditOptions(model=model_path, out=Path(out), steps=1))
    result = {"seconds": time.perf_counter() - t0}
result["peak_bytes"] = rss() - base
print(json.dumps(result))
'''


def child(what: str, model: Path, env: dict[str, str], out: Path) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, what, str(model), str(out), str(ROOT)],
                       capture_output=True, text=True, env={**os.environ, **env})
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="only the smallest case of each family")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.quick or c[2] in (8, 2)]
    print(f"torch threads {os.cpu_count()} cpus; ratios measured within this run")
    print(f"{'model':<14} {'size':>10} {'FP32 step':>11} {'audit':>9} {'P1 ratio':>9} "
          f"{'step peak':>11} {'audit peak':>11} {'P5 ratio':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        gpt = _gpt_file(tmpd)
        for family, unit, size, env in cases:
            model = MLP if family.startswith("residual") else gpt
            step = child("step", model, env, tmpd / "o")
            audit = child("audit", model, env, tmpd / "o")
            print(f"{family:<14} {f'{size} {unit}':>10} {step['seconds'] * 1e3:>9.2f}ms {audit['seconds']:>8.2f}s "
                  f"{audit['seconds'] / step['seconds']:>8.1f}x {step['peak_bytes'] / 2**20:>9.1f}MB "
                  f"{audit['peak_bytes'] / 2**20:>9.1f}MB {audit['peak_bytes'] / max(step['peak_bytes'], 1):>8.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
