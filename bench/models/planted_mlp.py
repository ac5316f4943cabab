"""A residual MLP with sensitive modules planted: their output is 20% off whenever autocast is on, so they add
error in low precision only (the planner benchmark's model).

PA_DEPTH blocks (default 24), PA_WIDTH wide (128), batch PA_BATCH (64); planted: blocks.{depth//8, depth//2,
depth - 2}.fc2.
"""

import os

import torch
from torch import nn

DEPTH = int(os.environ.get("PA_DEPTH", 24))
WIDTH = int(os.environ.get("PA_WIDTH", 128))
BATCH = int(os.environ.get("PA_BATCH", 64))
PLANTED = sorted({DEPTH // 8, DEPTH // 2, DEPTH - 2})


class Coarse(nn.Linear):
    """A Linear that is 20% off whenever autocast is on: error that enters in low precision only, and only here."""

    def forward(self, x):
        y = nn.functional.linear(x, self.weight, self.bias)
        if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
            y = y * 1.2
        return y


class Block(nn.Module):
    def __init__(self, width: int, planted: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.act = nn.GELU()
        self.fc2 = (Coarse if planted else nn.Linear)(width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class PlantedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(WIDTH, i in PLANTED) for i in range(DEPTH))
        self.head = nn.Linear(WIDTH, 16)
        with torch.no_grad():  # the planted blocks write strongly into the residual stream: their error matters
            for i in PLANTED:
                self.blocks[i].fc2.weight.mul_(4.0)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return PlantedMLP()


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 16, (BATCH,), generator=g)
