"""A forward that changes its input batch in place (an in-place normalisation): every pass starts from the batch
as loaded (audit.py, SubjectRun), so the audit equals the one of the same model written out of place. Before,
each pass saw the batch the previous one left (doubled again), and the audit called fp16 and bf16 unsafe with loss
changes of 0.9 and 2.7."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from precision_audit.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "golden"))

MODEL = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        SCALE
        return self.fc2(torch.relu(self.fc1(x)))


def build_model():
    torch.manual_seed(0)
    return Net()


def sample_batch():
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
'''


def test_a_model_that_changes_its_input_in_place_is_audited_as_written_out_of_place(tmp_path):
    from test_golden_audit import differences

    audits, codes = {}, {}
    for name, scale in (("in_place", "x.mul_(2.0)"), ("out_of_place", "x = x * 2.0")):
        src = tmp_path / f"{name}.py"
        src.write_text(MODEL.replace("SCALE", scale))
        codes[name] = main([str(src), "--out", str(tmp_path / name), "-q"])
        audits[name] = json.loads((tmp_path / name / "audit.json").read_text())
    assert codes["in_place"] == codes["out_of_place"] == 0
    diff = [d for d in differences(audits["out_of_place"], audits["in_place"])
            if ".source" not in d and ".options" not in d]
    assert diff == []
