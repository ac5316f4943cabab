"""A/B of the calls on the batch (issue 14, P1): the same audit with the format passes standing in for the re-runs
of calls on the batch itself, and with those calls re-run as before (``Ranks.batch_calls = False``, capture/ranks.py).

    python bench/batch_calls.py /tmp/rmb/gpt2/model.py --batch /tmp/rmb/gpt2/sample.pt [--rounds 3]

The model and batch files are those of bench/real_models.py (``real_models.prepare(name, folder)`` writes them;
bench/README.md shows the command). Each round runs both variants in fresh subprocesses, alternating; it prints
per variant the medians of the time spent in local re-runs, the reference pass, the noise floor with the second
order, and the audit after loading the model. The figures of the two variants are the same
(tests/capture/test_batch_calls.py); only the time differs. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, sys, time
from precision_audit.capture import CaptureSession
from precision_audit.capture.ranks import Ranks
from precision_audit.audit import AuditOptions, run_audit
Ranks.batch_calls = sys.argv[1] == "1"
spent = [0.0]
real = CaptureSession._rerun_once
def timed(self, *a, **k):
    t = time.perf_counter()
    try:
        return real(self, *a, **k)
    finally:
        spent[0] += time.perf_counter() - t
CaptureSession._rerun_once = timed
marks = []
run_audit(AuditOptions(model=sys.argv[2], batch=sys.argv[3] or None, out=sys.argv[4]),
          lambda m: marks.append((time.perf_counter(), str(m))))
end = time.perf_counter()
stages = [(m, e - t) for (t, m), (e, _) in zip(marks, marks[1:] + [(end, "")])]
def stage(prefix):
    return sum(d for m, d in stages if m.startswith(prefix))
print(json.dumps({"reruns": spent[0], "reference": stage("FP32 reference"), "noise": stage("FP32 noise"),
                  "after_loading": sum(d for m, d in stages if not m.startswith("loading"))}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", default="")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    results: dict[str, list[dict]] = {"re-run": [], "from the format passes": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for flag, name in (("0", "re-run"), ("1", "from the format passes")):
                p = subprocess.run([sys.executable, "-c", CHILD, flag, args.model, args.batch, str(Path(tmp) / "o")],
                                   capture_output=True, text=True, env=env, check=True)
                results[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    print(f"{'calls on the batch':<24} {'re-runs':>8} {'reference':>10} {'noise+2nd':>10} {'after loading':>14}")
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{name:<24} {med['reruns']:>7.2f}s {med['reference']:>9.2f}s {med['noise']:>9.2f}s "
              f"{med['after_loading']:>13.2f}s")


if __name__ == "__main__":
    main()
