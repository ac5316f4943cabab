"""Regenerate the stored audit.json files the record tests compare against.

    python tests/golden/make_golden.py                    # writes tests/golden/<sample>.audit.json
    python tests/golden/make_golden.py --variant NAME     # tests/golden/NAME/<sample>.audit.json, for this CPU

Run it only when a change to audit.json's content is intended, and say so in the commit: these files are the
reference that keeps restructuring (issue 13) and speed work (issue 14) from changing any figure. A change of
content regenerates every variant (each on a machine of its kind). ``--variant`` makes the files for a machine
whose CPU arithmetic differs from every stored variant's (tests/golden/arithmetic.py), at a commit whose figures
are the stored ones, and records the machine's probe in tests/golden/variants.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SAMPLES = ("mlp", "cnn", "tiny_gpt", "fp16_trouble")


def audit_of(name: str) -> dict:
    import torch

    from precision_audit.audit import AuditOptions, run_audit

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        opts = AuditOptions(model=str(ROOT / "sample_models" / name / "model.py"),
                            batch=str(ROOT / "sample_models" / name / "sample.pt"), out=Path(d) / "out")
        run_audit(opts)
        return json.loads((Path(d) / "out" / "audit.json").read_text())


def main(argv: list[str]) -> int:
    # the Python kernels, as the test suite runs them (tests/conftest.py): no compiled library from the user's cache
    os.environ["PRECISION_AUDIT_KERNEL_DIR"] = tempfile.mkdtemp(prefix="golden-kernels-")
    os.environ["PRECISION_AUDIT_AUTO_BUILD"] = "0"
    if len(argv) > 2 and argv[1] == "--variant":
        from arithmetic import VARIANTS, probe, variants

        dest = HERE / argv[2]
        dest.mkdir(exist_ok=True)
        known = variants()
        known[probe()] = argv[2]
        VARIANTS.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
    else:
        dest = Path(argv[1]) if len(argv) > 1 else HERE
    for name in SAMPLES:
        text = json.dumps(audit_of(name), indent=1, sort_keys=True) + "\n"
        # paths relative to the checkout, so the files compare equal in any clone or worktree
        (dest / f"{name}.audit.json").write_text(text.replace(str(ROOT), "<ROOT>"))
        print("wrote", dest / f"{name}.audit.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
