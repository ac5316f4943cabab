"""Sample model ``fp8_outliers``: two planted FP8 failures of different shapes (issue 16, docs/fp8.md).

Architecture: ``tokens`` Linear(256->256) -> per-token RMS normalisation -> a fixed per-channel gain (32 outlier
channels) -> ``channels`` Linear(256->256) -> GELU -> ``head`` Linear(256->64).

- ``tokens`` gets the batch itself, in which 4 of the 128 tokens (rows) are 2^17 times larger than the rest:
  one FP8 scale per tensor is set by them and flushes the ordinary tokens to zero. Rowwise scaling (one scale
  per token) repairs it.
- ``channels`` gets activations whose channels 32..63 (one 32-element MX block along the reduction dimension)
  are 2^17 times larger; the weight columns of those channels are 2^-17 smaller, so they add to the output as
  much as any other channel. A per-tensor or per-row scale is set by them and flushes the other channels; MXFP8
  gives that block its own scale, and BF16 has the range.
- ``head`` is an ordinary layer: every recipe is fine there.

Batch: ``(inputs, target)``, inputs float32 [128, 256], target float32 [128, 64]; loss: mean squared error.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

D, OUT, TOKENS = 256, 64, 128
OUTLIER = 2.0 ** 17
OUTLIER_TOKENS = (5, 40, 77, 120)
OUTLIER_CHANNELS = range(32, 64)


class Fp8Outliers(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Linear(D, D)
        self.channels = nn.Linear(D, D)
        self.head = nn.Linear(D, OUT)
        gain = torch.ones(D)
        gain[list(OUTLIER_CHANNELS)] = OUTLIER
        self.register_buffer("gain", gain)
        with torch.no_grad():
            self.channels.weight[:, list(OUTLIER_CHANNELS)] /= OUTLIER

    def forward(self, x):
        h = self.tokens(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.channels(h * self.gain)
        return self.head(F.gelu(h))


def build_model():
    torch.manual_seed(0)
    return Fp8Outliers()


def loss_fn(output, batch):
    return F.mse_loss(output, batch[1])


def sample_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, D, generator=g)
    x[list(OUTLIER_TOKENS)] *= OUTLIER
    return (x, torch.randn(TOKENS, OUT, generator=g))
