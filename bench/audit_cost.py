"""P1 and P5 on small models: the whole audit against one FP32 training step, in time and in peak memory.

    python bench/audit_cost.py [--quick] [--width 256] [--batch 64]

P1 (issue 33): (audit wall time - loading) / one FP32 forward+backward step (median of 5), the audit with default
options (emulated, both formats, ``--steps 0``), loading being the audit's own ``load_subject`` (the import of
the model file, ``build_model()``, the batch), for residual MLPs of depth 8, 16, 32, 64, 128 and tiny GPTs of 2, 6,
12 blocks. Goals: flat in depth (depth 128 within 1.2x of depth 32), the deep MLP at most 8x at depth 16 and 64.
P5: audit peak memory / one FP32 training step's peak, each measured in a fresh subprocess as peak RSS above
the process's RSS after the model and batch are built.
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

DEPTHS = (8, 16, 32, 64, 128)
CASES = [("residual MLP", "depth", d, {"PA_DEPTH": str(d)}) for d in DEPTHS] + \
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
    import precision_audit.audit as pa_audit
    from precision_audit.audit import AuditOptions, run_audit
    _load_subject, loads = pa_audit.load_subject, []
    def timed_load(*a, **k):
        t = time.perf_counter()
        try:
            return _load_subject(*a, **k)
        finally:
            loads.append(time.perf_counter() - t)
    pa_audit.load_subject = timed_load
    t0 = time.perf_counter()
    run_audit(AuditOptions(model=model_path, out=Path(out)))
    result = {"seconds": time.perf_counter() - t0, "load_s": sum(loads)}
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
    ap.add_argument("--width", type=int, default=256, help="the residual MLP's width (PA_WIDTH)")
    ap.add_argument("--batch", type=int, default=64, help="the residual MLP's batch (PA_BATCH)")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.quick or c[2] in (8, 2)]
    mlp_env = {"PA_WIDTH": str(args.width), "PA_BATCH": str(args.batch)}
    print(f"{os.cpu_count()} cpus; load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}; default audit "
          f"options; residual MLP {args.width} wide, batch {args.batch}; ratios measured within this run")
    print(f"{'model':<14} {'size':>10} {'FP32 step':>11} {'audit':>8} {'loading':>8} {'P1':>8} {'with load':>10} "
          f"{'step peak':>11} {'audit peak':>11} {'P5':>8}")
    p1s: dict[int, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        gpt = _gpt_file(tmpd)
        for family, unit, size, env in cases:
            mlp = family.startswith("residual")
            model = MLP if mlp else gpt
            env = {**env, **mlp_env} if mlp else env
            step = child("step", model, env, tmpd / "o")
            audit = child("audit", model, env, tmpd / "o")
            p1 = (audit["seconds"] - audit["load_s"]) / step["seconds"]
            if mlp:
                p1s[size] = p1
            print(f"{family:<14} {f'{size} {unit}':>10} {step['seconds'] * 1e3:>9.2f}ms {audit['seconds']:>7.2f}s "
                  f"{audit['load_s']:>7.2f}s {p1:>7.1f}x {audit['seconds'] / step['seconds']:>9.1f}x "
                  f"{step['peak_bytes'] / 2**20:>9.1f}MB {audit['peak_bytes'] / 2**20:>9.1f}MB "
                  f"{audit['peak_bytes'] / max(step['peak_bytes'], 1):>7.2f}x", flush=True)
    if 32 in p1s and 128 in p1s:
        print(f"flat in depth: depth 128's P1 is {p1s[128] / p1s[32]:.2f}x depth 32's (goal: at most 1.2x)")


if __name__ == "__main__":
    main()
