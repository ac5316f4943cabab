"""Regenerate the stored audit.json files the record tests compare against.

    python tests/golden/make_golden.py            # writes tests/golden/<sample>.audit.json

Run it only when a change to audit.json's content is intended, and say so in the commit: these files are the
reference that keeps restructuring (issue 13) and speed work (issue 14) from changing any figure.
"""

from __future__ import annotations

import json
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
    dest = Path(argv[1]) if len(argv) > 1 else HERE
    for name in SAMPLES:
        text = json.dumps(audit_of(name), indent=1, sort_keys=True) + "\n"
        # paths relative to the checkout, so the files compare equal in any clone or worktree
        (dest / f"{name}.audit.json").write_text(text.replace(str(ROOT), "<ROOT>"))
        print("wrote", dest / f"{name}.audit.json")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
