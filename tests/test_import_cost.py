"""What a whole audit imports beyond torch and precision_audit (docs/performance.md, "Imports"): an audit of a
plain model (no transformers, no FSDP, nothing compiled) must not pull in torch's heavy optional packages, each of
which costs a fresh process a sizeable part of a second (measured with ``python -X importtime``): DTensor (with
sympy and the symbolic shapes, ~0.7 s), Dynamo (~1.3 s), TensorBoard's writer (~0.2 s; the
event file is written directly: report/event_file.py). The audit runs in a fresh process, as the CLI's does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_AUDIT = r'''
import json, sys
from pathlib import Path
import torch
import precision_audit
from precision_audit.audit import AuditOptions, run_audit
heavy = ("torch.distributed.tensor", "torch._dynamo", "sympy", "torch.utils.tensorboard")
before = {m: m in sys.modules for m in heavy}
run_audit(AuditOptions(model=sys.argv[1], out=Path(sys.argv[2])))
print(json.dumps({"before": before, "after": {m: m in sys.modules for m in heavy}}))
'''


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_audit_of_a_plain_model_imports_no_heavy_optional_package(tmp_path, built_kernels):
    env = {**os.environ, "PRECISION_AUDIT_KERNEL_DIR": str(built_kernels[0]), "PRECISION_AUDIT_AUTO_BUILD": "0"}
    p = subprocess.run([sys.executable, "-c", _AUDIT, str(ROOT / "sample_models" / "mlp" / "model.py"),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert not any(out["before"].values()), f"imported before the audit began: {out['before']}"
    assert out["after"] == {"torch.distributed.tensor": False, "torch._dynamo": False, "sympy": False,
                            "torch.utils.tensorboard": False}
    assert (tmp_path / "out" / "audit.json").is_file()
