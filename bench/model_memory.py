"""Peak RSS of an audit on a large-parameter, small-activation model: what a copy of the model would cost.

    python bench/model_memory.py [--depth 12] [--width 1440] [--batch 8] [--steps 0] [--src DIR]

The residual MLP of bench/models/residual_mlp.py at 12 x 1440 has 49.8M parameters (199 MB in FP32) and, at
batch 8, small activations, so a whole-model copy would show as ~1x the parameters on top of everything else.
Prints, from a fresh subprocess, the audit's peak RSS (compute_audit: load, capture, analysis, plan; nothing
written) above the RSS once torch and precision_audit are imported (Linux: VmHWM reset through
/proc/self/clear_refs); the model's own parameters are part of it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "bench" / "models" / "residual_mlp.py"

CHILD = r'''
import gc, json, sys, time
if sys.argv[4]:  # --src: this source tree rather than the installed one (an editable install's finder too)
    sys.path.insert(0, sys.argv[4])
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                        and "editable" not in getattr(f, "__name__", "").lower()]
import torch
import precision_audit
from precision_audit.audit import AuditOptions, compute_audit
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
gc.collect(); reset_peak()
after_import = status("VmRSS")
t0 = time.perf_counter()
c = compute_audit(AuditOptions(model=sys.argv[1], out=sys.argv[2], steps=int(sys.argv[3])))
wall = time.perf_counter() - t0
peak = status("VmHWM")
print(json.dumps({"module": precision_audit.__file__, "params": c.audit["model"]["parameters"],
                  "after_import": after_import, "peak": peak, "wall_s": wall, "exit_code": c.exit_code}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--width", type=int, default=1440)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--src", default="", help="import precision_audit from this source tree (e.g. an older commit "
                                              "exported with git archive) to compare")
    args = ap.parse_args()
    env = {**os.environ, "PA_DEPTH": str(args.depth), "PA_WIDTH": str(args.width), "PA_BATCH": str(args.batch)}
    p = subprocess.run([sys.executable, "-c", CHILD, f"{MLP}:build_model", "/tmp/pa-model-memory",
                        str(args.steps), args.src], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    r = json.loads(p.stdout.strip().splitlines()[-1])
    mb = 2 ** 20
    print(f"precision_audit from {r['module']}")
    print(f"residual MLP {args.depth}x{args.width}, batch {args.batch}: {r['params'] / 1e6:.1f}M parameters "
          f"({r['params'] * 4 / mb:.0f} MB), audit {r['wall_s']:.1f} s, exit {r['exit_code']}")
    print(f"peak RSS above the post-import baseline (the model itself included): "
          f"{(r['peak'] - r['after_import']) / mb:.0f} MB")


if __name__ == "__main__":
    main()
