"""The second hostile catalogue, command-line side (issue 32; the first round is tests/cli/test_hostile_options.py
and test_hostile_process.py): each case runs the real CLI and must exit with its code, one error line naming the
problem, no traceback, nothing on stdout, and no ``--out`` folder when refused.

- ``verify`` with a policy the runtime cannot apply (a module in ``fp8_e4m3``) is refused before any arm trains
  (exit 2), where it trained the FP32 arm and then called the policy "unsafe" (exit 1);
- ``--tokens-per-step 10**400`` is refused (it raised OverflowError in the FP8 cost model: exit 3);
- a ``sample_batch()`` nested 1000 deep is a BatchError (it raised RecursionError: exit 3);
- a model whose module takes a plain object beside its tensor (``self.block(x, Cache())``) audits (exit 0), where the
  local re-run's ``copy.deepcopy`` failed and the batch was blamed (exit 2).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from models import TROUBLE, TROUBLE_BATCH, model_file
from test_hostile_options import _policy, run

HEADER = "import torch\nfrom torch import nn\n"
LINEAR = HEADER + "def build_model():\n    torch.manual_seed(0)\n    return nn.Linear(8, 4)\n"

DEEP = LINEAR + """
def sample_batch():
    b = torch.randn(4, 8)
    for _ in range(1000):
        b = [b]
    return b
"""

CACHE = HEADER + """
class Cache:
    def __init__(self):
        self.seen = []


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, cache):
        cache.seen.append(x.shape[0])
        return torch.relu(self.fc(x))


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.block(self.inp(x), Cache()))


def build_model():
    torch.manual_seed(0)
    return M()


def sample_batch():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
"""


def _fp8_module_policy(tmp_path: Path) -> str:
    """fp16_trouble's bf16 policy with its 'hot' module put in fp8_e4m3, a format the runtime has no autocast for."""
    import json

    path = Path(_policy(tmp_path, "bf16"))
    doc = json.loads(path.read_text())
    doc["modules"] = {"hot": {"format": "fp8_e4m3", "reason": "hand-edited"}}
    path.write_text(json.dumps(doc))
    return str(path)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    argv: object  # a function of the scratch folder giving the argv (without --out / -q)
    code: int
    words: tuple[str, ...] = ()  # the first is on the error line


CASES = [
    Case("verify-policy-with-an-fp8-module", lambda d: ["verify", TROUBLE, "--batch", TROUBLE_BATCH, "--policy",
                                                        _fp8_module_policy(d), "--steps", "2", "--device", "cpu"],
         2, ("verify cannot train this policy", "hot: fp8_e4m3", "fp8 section")),
    Case("tokens-per-step-10-to-the-400", lambda d: [model_file(d, LINEAR), "--formats", "bf16,fp8_e4m3",
                                                     "--tokens-per-step", str(10 ** 400)],
         2, ("--tokens-per-step must be a whole number from 1 to", "2**40")),
    Case("sample-batch-nested-1000-deep", lambda d: [model_file(d, DEEP)], 2,
         ("nests containers more than 64 deep", "sample_batch()")),
    Case("module-taking-a-cache-object", lambda d: [model_file(d, CACHE), "--steps", "0"], 0),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_field_case(tmp_path, case: Case):
    out_dir = tmp_path / "out"
    code, err, out = run([*case.argv(tmp_path), "--out", str(out_dir), "-q"], tmp_path)  # type: ignore[operator]
    assert "Traceback" not in err, err
    assert code == case.code, f"exit {code}; stderr:\n{err}"
    if case.code == 0:
        assert (out_dir / "audit.json").is_file()
        return
    error_lines = [line for line in err.splitlines() if re.match(r"precision-audit( [a-z-]+)?: error: ", line)]
    assert len(error_lines) == 1, err
    assert case.words[0] in error_lines[0], err
    for w in case.words[1:]:
        assert w in err, f"{w!r} missing from:\n{err}"
    assert out == ""
    assert not out_dir.exists(), "a refused command creates no --out folder (and trains no arm)"


def test_catalogue_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))
