"""A regressor whose inputs' scale grows faster and faster: one layer's input amax outruns FP8 delayed scaling.

The planted FP8 case of issue 36 (docs/policy.md, "FP8 delayed scaling"). ``body`` (Linear 32->64, no bias,
frozen) feeds ``head`` (Linear 64->8), the output. The batch at step ``t`` (1-based) is fixed inputs and targets
times one gain, ``2^(rate x t + accel x t^2 / 2)`` (a drifting sensor gain): its growth per step, ``rate + accel x t``
in log2, rises steadily (``accel``, default ``ACCEL``). ``head`` starts at the least-squares fit of the batch and
the model is linear, so that fit holds at every gain; the loss is relative (``loss_fn``: the squared error over the
targets' mean square), so SGD stays stable as the inputs grow and leaves ``head``'s weight where it is, while
``head``'s input grows with the gain (and its output gradient shrinks as 1/gain). Under Transformer Engine's
delayed scaling (the scale from the amax of earlier steps) a tensor saturates once its amax grows by more than
E4M3's rounding margin (464/448, 0.0506 in log2) from one step to the next: ``head``'s input does so at a step T
found by running it (tests/runtime/test_runtime_watch_fp8.py).

``build_model()`` (seeded), ``batch_at(step)`` the training batch of a step, ``sample_batch()`` step 1's,
``loss_fn(output, batch)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

#: The rise of the gain's growth per step (log2 per step, per step).
ACCEL = 2.0e-4


class Growth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 64, bias=False)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build_model() -> Growth:
    """Seeded; ``head`` starts at the least-squares fit of the batch (any step's: they differ by the gain)."""
    torch.manual_seed(0)
    model = Growth()
    model.body.requires_grad_(False)  # fixed features
    x, y = batch_at(0)
    with torch.no_grad():
        feats = torch.cat([model.body(x), torch.ones(x.shape[0], 1)], dim=1)
        sol = torch.linalg.lstsq(feats, y, driver="gelsd").solution
        model.head.weight.copy_(sol[:-1].T)
        model.head.bias.copy_(sol[-1])
    return model


def batch_at(step: int, accel: float = ACCEL, rate: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets at ``step``: fixed ones times ``2^(rate x step + accel x step^2 / 2)``
    (``accel=0``: a steady growth of ``rate`` log2 per step, the case delayed scaling tracks)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=g)
    y = torch.randn(256, 8, generator=g)
    gain = 2.0 ** (rate * step + accel * step * step / 2)
    return x * gain, y * gain


def sample_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return batch_at(1)


def loss_fn(output: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The relative squared error: the same at every gain."""
    y = batch[-1]
    return F.mse_loss(output.float(), y) / y.pow(2).mean()
