"""A module whose forward changes its own attributes (a call counter behind a warm-up factor): its local re-runs
start from the attributes it had before the call and leave no trace (capture/model_state.py,
``put_attributes_back``). Before, each re-run started from the counter the call itself had bumped and bumped it
again, once per format: the module's local error was that of another factor (rel_l2 ~1 in bf16), and its later
calls in the FP32 pass computed other values than the model does."""

from __future__ import annotations

import torch

from precision_audit.capture.session import CaptureConfig, CaptureSession
from precision_audit.formats import Format

FORMATS = (Format.FP16, Format.BF16)


class _Warm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.calls = torch.nn.Linear(32, 32), 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * min(1.0, self.calls / 4)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.warm, self.head = _Warm(), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.head(torch.relu(self.warm(torch.relu(self.warm(x)))))  # called twice: factors 1/4, 2/4


def test_a_call_counter_is_put_back_after_every_re_run():
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    truth = float(_Net()(x).pow(2).mean())  # the model's own first forward
    torch.manual_seed(0)
    model = _Net()
    with CaptureSession(model, lambda m: m(x), lambda y: y.pow(2).mean(), CaptureConfig(FORMATS)) as s:
        s.reference_run()
        res = s.result()
    assert res.reference.loss == truth  # the re-runs left the counter as the calls did
    warm = next(r for r in res.layers if r.name == "warm").formats
    # a re-run computes the call's own factor: its local error is rounding (~1e-3 in bf16), not another factor's
    assert warm[Format.FP16].local.rel_l2 < 1e-3 and warm[Format.BF16].local.rel_l2 < 1e-2
    assert model.warm.calls == 0  # and the model is as it was given
