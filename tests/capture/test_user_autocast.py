"""The model's own autocast(enabled=False) regions (capture/user_autocast.py).

A module called inside such a region runs in FP32 on a GPU: its format-pass output is float32 and its local
error (a re-run alone on its FP32 inputs, as the model runs it) is FP32's own, zero. The reference for the three
ways of writing the region is PyTorch's own handling of the one on the tensors' device type."""

from __future__ import annotations

import warnings

import pytest
import torch

from precision_audit.capture.session import CaptureConfig, CaptureSession
from precision_audit.formats import Format

FORMATS = (Format.FP16, Format.BF16)


class _Island(torch.nn.Module):
    """``b`` in FP32 inside an autocast-off region, written three ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)
        self.how = how

    def forward(self, x):
        h = self.a(x)
        if self.how == "device":
            region = torch.autocast(x.device.type, enabled=False)
        elif self.how == "cuda":
            region = torch.autocast("cuda", enabled=False)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                region = torch.cuda.amp.autocast(enabled=False)
        with region:
            h = torch.tanh(self.b(h.float()))
        return self.head(h)


def _figures(how: str) -> dict:
    torch.manual_seed(0)
    model, x = _Island(how), torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
        s.reference_run()
        for f in FORMATS:
            s.format_run(f)
        res = s.result()
    return {r.name: {f.value: (fs.local.rel_l2 if fs.local else fs.local_note, fs.accumulated.rel_l2,
                               sorted(fs.output_dtypes), fs.loss_impact)
                     for f, fs in r.formats.items()} for r in res.layers}


@pytest.mark.parametrize("how", ["device", "cuda", "amp"])
def test_a_module_inside_an_autocast_off_region_is_measured_in_fp32(how):
    got = _figures(how)
    for f in ("fp16", "bf16"):
        local, _, dtypes, impact = got["b"][f]
        assert local == 0.0 and impact == 0.0  # re-run with autocast off, as the model runs it
        assert dtypes == ["float32"]  # the format pass: FP32 inside the region
        assert got["a"][f][2] == [{"fp16": "float16", "bf16": "bfloat16"}[f]]  # and low precision outside it
    assert got == _figures("device")  # "cuda" hard-coded or torch.cuda.amp: as PyTorch runs the device's own


def test_torch_autocast_is_put_back_after_the_session():
    from torch.amp.autocast_mode import autocast

    before = (autocast.__init__, autocast.__enter__, autocast.__exit__)
    model = _Island("cuda")
    with pytest.raises(RuntimeError, match="boom"):
        with CaptureSession(model, lambda m: m(torch.randn(2, 16)), lambda y: y.sum(), CaptureConfig(FORMATS)):
            assert autocast.__enter__ is not before[1]
            raise RuntimeError("boom")
    assert (autocast.__init__, autocast.__enter__, autocast.__exit__) == before
