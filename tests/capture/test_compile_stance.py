"""The session's force_eager stance (capture/compile_stance.py): set without importing Dynamo where nothing is compiled,
and still in force for code a model compiles during the session. Each case runs in a fresh process, where Dynamo is
not imported yet (this test process has usually imported it), with the compiled kernels (the audit's default where
they build): the Python kernels' GEMM emulation mode (emulation/gemm_mode.py) imports Dynamo by itself on its first
op, as torch wraps every dispatch mode's ``__torch_dispatch__`` in ``torch._dynamo.disable``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PRELUDE = r'''
import json, sys
import torch
from torch import nn
from precision_audit.capture import CaptureConfig, CaptureSession
from precision_audit.formats import Format
assert "torch._dynamo" not in sys.modules, "precision_audit imported Dynamo"
from precision_audit.emulation import compiled
assert compiled.load(), "the compiled kernels did not load"
runs = [0]

def counting_backend(gm, example_inputs):
    def compiled(*args):
        runs[0] += 1
        return gm.forward(*args)
    return compiled

def session(model, x):
    cfg = CaptureConfig(formats=(Format.BF16,), mode="emulated", kernels="compiled")
    return CaptureSession(model, lambda m: m(x), lambda y: y.float().pow(2).mean(), cfg)
'''

_NOTHING_COMPILED = _PRELUDE + r'''
model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 8)
with session(model, x) as s:
    s.reference_run()
    s.format_run(Format.BF16)
kernels = "compiled" if compiled.is_loaded() else "python"
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "kernels": kernels}))
'''

# the model compiles a function inside its forward (Dynamo imported there, during the session's first pass)
_COMPILED_IN_FORWARD = _PRELUDE + r'''
class Lazy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.fn = None
    def forward(self, x):
        if self.fn is None:
            self.fn = torch.compile(lambda t: torch.tanh(t) * 2, backend=counting_backend)
        return self.fn(self.fc(x))
model, x = Lazy(), torch.randn(4, 8)
with session(model, x) as s:
    s.reference_run()
    s.format_run(Format.BF16)
    inside = runs[0]
model(x)
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "inside": inside, "after": runs[0],
                  "meta_path": [type(f).__name__ for f in sys.meta_path]}))
'''


def _run(code: str, kernel_dir) -> dict:
    env = {**os.environ, "PRECISION_AUDIT_KERNEL_DIR": str(kernel_dir), "PRECISION_AUDIT_AUTO_BUILD": "0"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_session_over_an_uncompiled_model_does_not_import_dynamo(built_kernels):
    assert _run(_NOTHING_COMPILED, built_kernels[0]) == {"dynamo": False, "kernels": "compiled"}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_code_compiled_during_the_session_runs_eagerly_and_compiled_after_it(built_kernels):
    out = _run(_COMPILED_IN_FORWARD, built_kernels[0])
    assert out["dynamo"] is True
    assert out["inside"] == 0, "the compiled function ran its compiled code inside the session (force_eager missed)"
    assert out["after"] >= 1, "the stance was not put back when the session closed"
    assert "_WhenDynamoLoads" not in out["meta_path"], "the import watcher stayed in sys.meta_path"
