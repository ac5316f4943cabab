"""Residual MLP used by the benchmarks: DEPTH blocks of LayerNorm -> Linear -> GELU -> Linear, WIDTH wide.

Environment variables pick the size (defaults: the probe of DESIGN.md §3): PA_DEPTH=8, PA_WIDTH=512,
PA_BATCH=128.
"""

import os

import torch
from torch import nn

DEPTH = int(os.environ.get("PA_DEPTH", 8))
WIDTH = int(os.environ.get("PA_WIDTH", 512))
BATCH = int(os.environ.get("PA_BATCH", 128))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, depth: int = DEPTH, width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 16)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build_model():
    torch.manual_seed(0)
    return ResidualMLP()


def sample_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, 16, (BATCH,), generator=g)
