"""Sample model ``fp16_trouble``: a tiny regressor with two deliberate FP16 problems.

Architecture (input x: float32 [16, 32], output [16, 8]):
    hot    Linear(32->64) whose weights and bias are multiplied by HOT_SCALE = 1e5 at init
    norm   LayerNorm(64)          (a separate module: brings the values back to O(1))
    act    GELU
    head   Linear(64->8)
    faint  Sequential(Linear(32->32), Tanh, Linear(32->8))   -- a side branch
    output = head(act(norm(hot(x)))) + FAINT_SCALE * faint(x),   FAINT_SCALE = 1e-7
           (the tiny multiplier is applied AFTER ``faint``, outside it)

Batch: ``(inputs, targets)`` with inputs float32 [16, 32] ~ N(0, 1) and targets float32 [16, 8]
~ N(0, 1). No ``loss_fn``: the tool infers a mean-reduced MSE from a float target of the output's
shape. (Every number below is measured in FP32 on ``sample.pt`` and checked by
tests/e2e/test_sample_models.py.)

What the audit should find:

1. Activation overflow in ``hot`` (FP16 only). In FP32 max |hot(x)| is about 2.0e5 (between 1e5 and
   1e6; the hot weights themselves are <= ~1.8e4, so storing them is fine). That is above FP16's
   max 65504, so ~28% of ``hot``'s outputs become +-inf when stored in FP16, and
   ``norm`` then turns whole rows into NaN; the FP16 loss is non-finite. BF16 (max ~3.4e38) has
   ~1e33x headroom and is fine (only its usual ~3-digit rounding). Expected plan: BF16 is safe; under
   FP16 ``hot`` must run/store in FP32 (or the model must be run in BF16). ``norm`` itself is fine
   once its input is finite.

2. Gradient underflow in ``faint`` (FP16 without loss scaling). Because of the 1e-7 multiplier the
   gradient reaching faint's output is ~1e-7 x the upstream gradient (~1e-2 for a mean MSE over
   128 elements): median |grad| of faint's output is ~1.0e-9 (max ~4.4e-9), below FP16's smallest
   subnormal 2^-24 (~5.96e-8); inside the branch (faint.0, faint.1) the medians are ~2.5e-10-3.5e-10
   and faint's parameter gradients are ~1e-9-1e-8 (max ~1.1e-8). Unscaled, all of them flush to
   zero in FP16. With a loss scale of 2^10-2^14 they move above 2^-24 (2^12 * 1e-9 ~ 4e-6).
   The largest gradient anywhere (parameters and module outputs) is ~0.18 (head.weight; well under
   16), so a scale of 2^12 cannot overflow 65504: the audit should recommend loss scaling for FP16 with an
   init scale around 2^12 (and BF16, whose range matches FP32, needs none).
   Side effect, also real: ``hot``'s output gradient is small too, because ``norm`` divides the
   gradient by its input's ~6e4 std -- median ~1.4e-8, ~90% of it below 2^-24 unscaled (hot.weight /
   hot.bias grads: median ~1e-7, ~1/3 below 2^-24). The same loss scale fixes it.
"""
import torch
import torch.nn as nn

IN_FEATURES = 32
HIDDEN = 64
OUT_FEATURES = 8
BATCH_SIZE = 16
HOT_SCALE = 1e5
FAINT_SCALE = 1e-7
SEED = 0


class FP16Trouble(nn.Module):
    def __init__(self):
        super().__init__()
        self.hot = nn.Linear(IN_FEATURES, HIDDEN)
        with torch.no_grad():
            self.hot.weight.mul_(HOT_SCALE)
            self.hot.bias.mul_(HOT_SCALE)
        self.norm = nn.LayerNorm(HIDDEN)
        self.act = nn.GELU()
        self.head = nn.Linear(HIDDEN, OUT_FEATURES)
        self.faint = nn.Sequential(
            nn.Linear(IN_FEATURES, 32), nn.Tanh(), nn.Linear(32, OUT_FEATURES))
        self.faint_scale = FAINT_SCALE

    def forward(self, x):
        main = self.head(self.act(self.norm(self.hot(x))))
        return main + self.faint_scale * self.faint(x)


def build_model():
    """A freshly initialised FP16Trouble; the seed is fixed so every call gives identical weights."""
    torch.manual_seed(SEED)
    return FP16Trouble()


def sample_batch():
    """Deterministic ``(inputs [16, 32] float32, targets [16, 8] float32)``."""
    g = torch.Generator().manual_seed(1234)
    inputs = torch.randn(BATCH_SIZE, IN_FEATURES, generator=g)
    targets = torch.randn(BATCH_SIZE, OUT_FEATURES, generator=g)
    return (inputs, targets)
