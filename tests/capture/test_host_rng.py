"""Models that draw from Python's or NumPy's global generator in their forward (precision_audit/host_rng.py).

wav2vec2 and HuBERT draw their SpecAugment masks and layer drop from ``np.random``. Every pass must draw the same
masks as the FP32 pass, and every re-run the same as its call; before, only torch's generator was reseeded, so
each pass masked other positions: a small HF Wav2Vec2ForCTC's fp16 loss change read 2.3e-3, 7.0e-4 or 2.3e-4
from one audit to the next (1.1e-6 with the same masks)."""

from __future__ import annotations

import random

import numpy as np
import torch

from precision_audit.capture.session import CaptureConfig, CaptureSession
from precision_audit.formats import Format

FORMATS = (Format.FP16, Format.BF16)


class _Mask(torch.nn.Module):
    """Zeroes half of the features, drawn from NumPy's generator (SpecAugment's way)."""

    def forward(self, x):
        keep = torch.from_numpy(np.random.rand(x.shape[-1]) > 0.5).to(x.dtype)
        return x * keep


class _Scale(torch.nn.Module):
    """Scales by a factor drawn from Python's generator."""

    def forward(self, x):
        return x * (0.5 + random.random())


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.mask, self.scale, self.b = torch.nn.Linear(16, 64), _Mask(), _Scale(), torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.b(self.scale(torch.relu(self.mask(self.a(x)))))


def _figures() -> dict:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
        s.reference_run()
        runs = {f.value: s.format_run(f) for f in FORMATS}
        res = s.result()
    return {"loss": {f: r.loss for f, r in runs.items()},
            **{r.name: {f.value: (fs.local.rel_l2 if fs.local else fs.local_note, fs.accumulated.rel_l2,
                                  fs.loss_impact) for f, fs in r.formats.items()} for r in res.layers}}


def test_every_pass_and_re_run_draws_the_fp32_passs_host_randomness():
    got = _figures()
    for f in ("fp16", "bf16"):
        assert got["mask"][f][0] == 0.0 and got["scale"][f][0] == 0.0  # re-runs: the call's own draws
        # the passes mask the same features: the output moves by rounding only (different masks: O(1))
        assert got[""][f][1] < 2e-2, got[""][f]
    assert got == _figures()  # and the same from one audit to the next


def test_the_users_generators_are_as_they_were():
    random.seed(123)
    np.random.seed(456)
    before = random.getstate(), np.random.get_state()
    _figures()
    after = random.getstate(), np.random.get_state()
    assert after[0] == before[0]
    assert after[1][0] == before[1][0] and np.array_equal(after[1][1], before[1][1]) and after[1][2:] == before[1][2:]
