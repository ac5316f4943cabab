"""Models the tests share: the sample models' files, model-file sources and small in-memory models.

Tests that write a model file for the command line or ``run_audit`` build it from :data:`HEADER` (the imports a
model file needs) and :func:`model_file`; :data:`LINEAR` is the smallest complete model file (a seeded
``nn.Linear(8, 4)`` on [N, 8] inputs), the base most bad-input cases start from. :func:`tiny_mlp` is the small
Linear-ReLU-Linear model the runtime and record tests apply policies to.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_models"

#: The imports a test's model file starts with.
HEADER = "import torch\nfrom torch import nn\n"

#: A linear model on [N, 8] inputs, seeded: the smallest model file an audit accepts.
LINEAR_BODY = "def build_model():\n    torch.manual_seed(0)\n    return nn.Linear(8, 4)\n"
LINEAR = HEADER + LINEAR_BODY


def sample(name: str) -> tuple[str, str]:
    """(model.py, sample.pt) of the sample model ``name`` (sample_models/<name>/)."""
    return str(SAMPLES / name / "model.py"), str(SAMPLES / name / "sample.pt")


MLP, MLP_BATCH = sample("mlp")
TROUBLE, TROUBLE_BATCH = sample("fp16_trouble")


def model_file(d: Path, body: str, name: str = "model.py") -> str:
    """Write ``body`` (dedented) to ``d / name`` and return its path."""
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(body))
    return str(p)


def tiny_mlp(d_in: int = 8, hidden: int = 8, d_out: int = 4) -> nn.Sequential:
    """``Linear(d_in, hidden) -> ReLU -> Linear(hidden, d_out)``; modules named "0", "1", "2"."""
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


__all__ = ["HEADER", "LINEAR", "LINEAR_BODY", "MLP", "MLP_BATCH", "ROOT", "SAMPLES", "TROUBLE", "TROUBLE_BATCH",
           "model_file", "sample", "tiny_mlp"]


class DtypeDependentDraws(nn.Module):
    """Dropout after a draw whose size depends on the dtype, as CUDA's dropout kernel advances the RNG
    offset by a dtype-dependent amount: seeding alone gives other masks in fp16/bf16 than in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 64)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(64, 8)

    def forward(self, x):
        h = self.lin(x)
        torch.rand(64 if h.dtype == torch.float32 else 16, device=h.device)
        return self.out(self.drop(h))
