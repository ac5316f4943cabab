"""Models with TorchScript in them: a scripted submodule inside an eager model is audited (its ops count as its
eager parent's own work: TorchScript modules take no Python hooks), and a model scripted as a whole is refused
with one clear message (exit 2), not an internal error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

from precision_audit.capture import CaptureConfig, CaptureSession
from precision_audit.formats import Format

ROOT = Path(__file__).resolve().parents[2]

MODEL = '''
import torch, torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.jit.script(nn.Linear(16, 16))
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def build_model():
    torch.manual_seed(0)
    return {wrap}(Net())


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
'''


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.jit.script(nn.Linear(16, 16))
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_scripted_submodule_is_measured_as_part_of_its_parent_and_the_model_is_restored():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig((Format.FP16,))) as s:
        s.reference_run()
        s.format_run(Format.FP16)
        layers = {r.name: r for r in s.result().layers}
    assert set(layers) == {"", "b"}  # no record for the scripted "a": it takes no hooks
    assert layers["b"].formats[Format.FP16].local is not None
    assert layers[""].formats[Format.FP16].accumulated.n == 8 * 4
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules()
               if not isinstance(m, torch.jit.ScriptModule))
    assert all(p.grad is None for p in model.parameters())


def _audit(tmp_path: Path, wrap: str) -> subprocess.CompletedProcess:
    (tmp_path / "model.py").write_text(MODEL.format(wrap=wrap))
    return subprocess.run([sys.executable, "-m", "precision_audit", str(tmp_path / "model.py"), "--out",
                           str(tmp_path / "out"), "--formats", "fp16", "--quiet"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_the_cli_audits_a_model_with_a_scripted_submodule(tmp_path):
    r = _audit(tmp_path, "")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "out" / "audit.json").exists()


def test_a_model_scripted_as_a_whole_is_refused_in_one_message(tmp_path):
    r = _audit(tmp_path, "torch.jit.script")
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.count("precision-audit: error") == 1 and "Traceback" not in r.stderr
    assert "TorchScript" in r.stderr and "eager" in r.stderr
    assert not (tmp_path / "out").exists()
