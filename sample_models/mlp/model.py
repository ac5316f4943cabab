"""Sample model ``mlp``: a plain (residual-free) 3-layer MLP classifier.

Architecture: Linear(64->128) -> ReLU -> Linear(128->128) -> GELU -> Linear(128->16).
Every dimension -- batch 32, features 64/128/128, classes 16 -- is a multiple of 8, so the
GEMMs are Tensor-Core aligned for FP16/BF16 (and FP8 needs 16: also satisfied).

Batch: ``(inputs, target)`` with inputs float32 [32, 64] and target int64 class labels [32] in
[0, 16). No ``loss_fn`` is defined: the tool infers cross-entropy from ``(inputs, target)``.

What the audit should find: a boring, healthy model. FP16 and BF16 errors are small (BF16 a bit
larger, ~1e-3-1e-2 relative, because of its 8-bit mantissa), no overflow, no gradient underflow
worth mentioning at the recommended loss scale, and NO alignment findings. It is the "clean"
baseline the other samples are compared against.
"""
import torch
import torch.nn as nn

IN_FEATURES = 64
HIDDEN = 128
NUM_CLASSES = 16
BATCH_SIZE = 32
SEED = 0


class MLP(nn.Module):
    def __init__(self, in_features=IN_FEATURES, hidden=HIDDEN, num_classes=NUM_CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(hidden, hidden)
        self.act2 = nn.GELU()
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


def build_model():
    """A freshly initialised MLP; the seed is fixed so every call gives identical weights."""
    torch.manual_seed(SEED)
    return MLP()


def sample_batch():
    """Deterministic ``(inputs [32, 64] float32, target [32] int64)``."""
    g = torch.Generator().manual_seed(1234)
    inputs = torch.randn(BATCH_SIZE, IN_FEATURES, generator=g)
    target = torch.randint(0, NUM_CLASSES, (BATCH_SIZE,), generator=g)
    return (inputs, target)
