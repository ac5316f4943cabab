"""A model file that returns ``torch.compile(model)``: audited as its eager module (the wrapper made transparent,
compiled submodules run eagerly for the session), with the same figures as the same file without the compile.
Before, Dynamo traced the audit's own hooks and the audit stopped with a FakeTensor error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from precision_audit.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "golden"))

MODEL = '''
import torch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.block, self.fc2 = torch.nn.Linear(32, 64), Block(), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(self.block(self.fc1(x)))


def build_model():
    torch.manual_seed(0)
    return WRAP(Net())


def sample_batch():
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
'''


def test_a_compiled_model_is_audited_as_its_eager_module(tmp_path):
    from test_golden_audit import differences

    figures = {}
    for name, wrap in (("eager", "(lambda m: m)"), ("compiled", "torch.compile")):
        src = tmp_path / f"{name}.py"
        src.write_text(MODEL.replace("WRAP", wrap))
        assert main([str(src), "--out", str(tmp_path / name), "-q"]) in (0, 1)
        figures[name] = json.loads((tmp_path / name / "audit.json").read_text())
    assert [L["name"] for L in figures["compiled"]["layers"]] == ["", "fc1", "block", "block.fc", "fc2"]
    diff = [d for d in differences(figures["eager"], figures["compiled"]) if ".source" not in d and ".options" not in d]
    assert diff == []
