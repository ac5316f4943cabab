"""A regressor whose targets grow by a fixed factor per training step: one layer's activations grow with them.

The planted case of issue 36 (docs/policy.md, "Watch and forecast"). ``body`` (Linear 32->64, tanh) feeds
``head`` (Linear 64->8), the model's output. The batch at step ``t`` (1-based) is fixed inputs and targets
``base x GROWTH^t``: to follow them, SGD grows ``head``'s weights, and its output amax grows by about the same
factor per step. In FP16 ``head``'s output passes 65504 at a step T found by running it (measured figures in
tests/runtime/test_runtime_watch.py's docstring); in FP32 and BF16 nothing overflows.

``build_model()`` (seeded), ``batch_at(step)`` the training batch of a step, ``sample_batch()`` step 1's.
"""

from __future__ import annotations

import torch
import torch.nn as nn

#: The targets' growth per step.
GROWTH = 1.02
#: The targets' size at step 0.
BASE = 1.0


class Growth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(32, 64)
        self.act = nn.Tanh()
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.body(x)))


def build_model() -> Growth:
    torch.manual_seed(0)
    model = Growth()
    model.body.requires_grad_(False)  # fixed features: training is a linear regression of head, stable at any size
    return model


def batch_at(step: int, growth: float = GROWTH) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs (fixed) and the targets at ``step``: ``BASE x growth^step`` times a fixed pattern."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 32, generator=g)
    pattern = torch.randn(32, 8, generator=g)
    return x, pattern * (BASE * growth ** step)


def sample_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return batch_at(1)
