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
        self.fc1, self.block, self.fc2 = torch.nn.Linear(32, 64), INNER(Block()), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(self.block(self.fc1(x)))


def build_model():
    torch.manual_seed(0)
    return OUTER(Net())


def sample_batch():
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
'''


def test_a_compiled_model_is_audited_as_its_eager_module(tmp_path):
    import precision_audit as pa
    from test_golden_audit import differences

    figures = {}
    plain = "(lambda m: m)"
    for name, outer, inner in (("eager", plain, plain), ("compiled", "torch.compile", plain),
                               ("compiled_block", plain, "torch.compile")):
        src = tmp_path / f"{name}.py"
        src.write_text(MODEL.replace("OUTER", outer).replace("INNER", inner))
        assert main([str(src), "--out", str(tmp_path / name), "-q"]) in (0, 1)
        figures[name] = json.loads((tmp_path / name / "audit.json").read_text())
    for name in ("compiled", "compiled_block"):  # names as the runtime sees them: no "_orig_mod"
        assert [L["name"] for L in figures[name]["layers"]] == ["", "fc1", "block", "block.fc", "fc2"]
        diff = [d for d in differences(figures["eager"], figures[name]) if ".source" not in d and ".options" not in d]
        assert diff == [], name

    # a policy naming a module inside the compiled block applies to that model
    policy = json.loads((tmp_path / "compiled_block" / "policy.json").read_text())
    policy["modules"] = {"block.fc": {"format": "fp32", "reason": "test"}}
    (tmp_path / "pinned.json").write_text(json.dumps(policy))
    sys.path.insert(0, str(tmp_path))
    try:
        import compiled_block
    finally:
        sys.path.remove(str(tmp_path))
    handle = pa.apply_policy(compiled_block.build_model(), pa.load_policy(tmp_path / "pinned.json"))
    assert "1 module(s) overridden" in repr(handle)
