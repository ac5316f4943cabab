"""Modules that write their input in place, and tensors changed after autograd saved them.

- ``nn.SiLU(inplace=True)`` and friends overwrite their input with their output. Their local re-runs start from
  a copy of the FP32 input taken before the call (capture/reference_pass.py, ``pre_call``); before, a re-run
  started from the already overwritten tensor and wrote into it again, once per format, so the FP32 pass's own
  activations (and its loss) were wrong for every non-idempotent in-place module.
- A module that changes its input in place without saying so (no ``inplace`` attribute) is not re-run; its local
  error is "not measured" and the FP32 pass is what the model computes.
- A tensor changed in place after autograd saved it raises in the audit's backward as in a training step (the
  audit's saved-tensor hooks would otherwise skip autograd's version check).
"""

from __future__ import annotations

import pytest
import torch

from precision_audit.capture.reference_pass import IN_PLACE_NOTE
from precision_audit.capture.session import CaptureConfig, CaptureSession
from precision_audit.errors import ModelRunError
from precision_audit.formats import Format

FORMATS = (Format.FP16, Format.BF16)


class _Scale(torch.nn.Module):
    def forward(self, x):
        return x.mul_(1.5).add_(0.25)  # in place, and no ``inplace`` attribute says so


class _Net(torch.nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
        self.act1 = torch.nn.SiLU(inplace=inplace)
        self.act2 = torch.nn.LeakyReLU(0.1, inplace=inplace)
        self.scale = _Scale()

    def forward(self, x):
        return self.head(self.act2(self.scale(self.fc2(self.act1(self.fc1(x))))))


def _audit(model: torch.nn.Module, x: torch.Tensor) -> dict:
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
        s.reference_run()
        for f in FORMATS:
            s.format_run(f)
        res = s.result()
    layers = {r.name: {f.value: (fs.local.rel_l2 if fs.local else fs.local_note, fs.accumulated.rel_l2,
                                 fs.loss_impact, fs.impact_measured)
                       for f, fs in r.formats.items()} for r in res.layers}
    return {"loss": res.reference.loss, "runs": {f.value: res.runs[f].loss for f in FORMATS}, "layers": layers}


def test_an_in_place_activation_is_measured_as_its_out_of_place_twin():
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    inplace = _Net(True)
    torch.manual_seed(0)
    outofplace = _Net(False)
    want = float(outofplace(x.clone()).pow(2).mean())
    inplace(x).pow(2).mean().backward()  # a valid training step: nothing autograd saved is changed afterwards
    inplace.zero_grad(set_to_none=True)

    got_in, got_out = _audit(inplace, x), _audit(outofplace, x)
    assert got_in["loss"] == pytest.approx(want, rel=1e-6)  # the FP32 pass computes what the model computes
    assert got_in == got_out
    for name in ("act1", "act2"):  # re-run (from the copy), not skipped
        assert all(isinstance(v[0], float) for v in got_in["layers"][name].values())
    assert all(v[0] == IN_PLACE_NOTE for v in got_in["layers"]["scale"].values())


def test_a_tensor_changed_after_autograd_saved_it_raises_as_in_training():
    class Bad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            y = self.fc(x)
            z = (y * y).mean()  # saves y
            y.mul_(0.5)
            return self.head(y) + z

    torch.manual_seed(0)
    model, x = Bad(), torch.randn(4, 8, 16)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).pow(2).mean().backward()  # what the user's training step does
    model.zero_grad(set_to_none=True)
    with pytest.raises(ModelRunError, match="modified by an inplace operation"):
        with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
            s.reference_run()
